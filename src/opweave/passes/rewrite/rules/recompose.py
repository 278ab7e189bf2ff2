"""Recomposition: decomposed softmax and log-softmax back into the fused ops."""
from __future__ import annotations

from ._helpers import X, Var, example, op, require, rule


def _stable_parts(dim_node: str):
    shifted = op("sub", X, op("amax", X, bind=dim_node), bind="shifted")
    return shifted, op("exp", shifted, bind="e")


def _softmax_example(b, x):
    shifted = b.op("sub", x, b.op("amax", x, dims=[2], keepdim=True))
    e = b.op("exp", shifted)
    return b.op("div", e, b.op("sum", e, dims=[2], keepdim=True))


def _reduced_dim(b, m, *names) -> int:
    rank = b.type(m["x"]).rank
    dims = {tuple(d % rank for d in m.node(n).attr("dims")) for n in names}
    require(len(dims) == 1 and len(next(iter(dims))) == 1, "not one shared dim")
    require(all(m.node(n).attr("keepdim") for n in names), "keepdim")
    return next(iter(dims))[0]


_shifted, _exp = _stable_parts("mx")


@rule("softmax-recompose", op("div", _exp, op("sum", Var("e"), bind="s"), rounding="none"),
      "recompose", [example(_softmax_example, (2, 3, 5))])
def softmax_recompose(b, m):
    """exp(x - max x) / sum exp(x - max x) = softmax(x)"""
    require(b.type(m["x"]).dtype.is_floating_point, "integers")
    return b.op("softmax", m["x"], dim=_reduced_dim(b, m, "mx", "s"))


def _log_softmax_example(b, x):
    shifted = b.op("sub", x, b.op("amax", x, dims=[1], keepdim=True))
    return b.op("sub", shifted, b.op("log", b.op("sum", b.op("exp", shifted), dims=[1], keepdim=True)))


@rule("log-softmax-recompose",
      op("sub", _shifted, op("log", op("sum", op("exp", Var("shifted")), bind="s"))),
      "recompose", [example(_log_softmax_example, (4, 7))])
def log_softmax_recompose(b, m):
    """(x - max x) - log sum exp(x - max x) = log_softmax(x)"""
    require(b.type(m["x"]).dtype.is_floating_point, "integers")
    return b.op("log_softmax", m["x"], dim=_reduced_dim(b, m, "mx", "s"))
