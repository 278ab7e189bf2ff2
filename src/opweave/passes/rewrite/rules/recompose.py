"""Recomposition: decomposed softmax, log-softmax and GELU back into the fused ops."""
from __future__ import annotations

import math

from ._helpers import F32, Const, X, Var, example, op, require, rule, same


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


# GELU written out, as models and exporters spell it. Fused back into one op, it can be a
# product's epilogue (a oneDNN post-op), where the written-out form is a generated kernel
# of eight ops with a scalar power in it (GPT-2's MLP: 3.9 ms a call at [128, 3072]).
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_2 = math.sqrt(2.0)


def _near(b, cid: int, value: float) -> bool:
    """Whether class `cid` is a one-element float constant within float32 rounding of
    `value` (models write these constants with more or fewer digits)."""
    if b.type(cid).numel != 1:  # (never reads a weight's data: it may be folded lazily)
        return False
    t = b.value(cid)
    return (t is not None and t.dtype.is_floating_point
            and math.isclose(t.reshape(()).item(), value, rel_tol=1e-6))


def _gelu(b, m, approximate: str, constants: dict[str, float]):
    require(b.type(m["x"]).dtype.is_floating_point, "integers")
    for name, value in constants.items():
        require(_near(b, m[name], value), f"{name} is not {value}")
    return same(b, m.root, b.op("gelu", m["x"], approximate=approximate))


def _gelu_tanh_example(b, x):
    cube = b.op("pow", x, b.scalar(3.0, F32))
    inner = b.op("mul", b.op("add", x, b.op("mul", cube, b.scalar(0.044715, F32))),
                 b.scalar(_SQRT_2_OVER_PI, F32))
    return b.op("mul", b.op("mul", x, b.scalar(0.5, F32)),
                b.op("add", b.op("tanh", inner), b.scalar(1.0, F32)))


@rule("gelu-tanh-recompose",
      op("mul", op("mul", X, Const("half")),
         op("add", op("tanh", op("mul", op("add", X, op("mul", op("pow", X, Const("three")),
                                                         Const("kappa"))), Const("beta"))),
            Const("one"))),
      "recompose", [example(_gelu_tanh_example, (4, 7))])
def gelu_tanh_recompose(b, m):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = gelu(x, tanh) (GPT-2's gelu_new)"""
    return _gelu(b, m, "tanh", {"half": 0.5, "one": 1.0, "three": 3.0, "kappa": 0.044715,
                                "beta": _SQRT_2_OVER_PI})


def _erf_part(x_scaled_by: str):
    """1 + erf(x / sqrt 2), the scaling a division or a product by its reciprocal."""
    return op("add", op("erf", op(("div", "mul"), X, Const("s"), bind=x_scaled_by)), Const("one"))


def _erf_scale(b, m) -> None:
    node = m.node("scaled")
    if node.op == "div":
        require(node.attr("rounding") == "none", "not a true division")
        require(_near(b, m["s"], _SQRT_2), "not a division by sqrt 2")
    else:
        require(_near(b, m["s"], 1.0 / _SQRT_2), "not a product by 1 / sqrt 2")


def _gelu_erf_example(b, x):  # torch.onnx's spelling of gelu (opset < 20)
    erf = b.op("erf", b.op("div", x, b.scalar(_SQRT_2, F32)))
    return b.op("mul", b.op("mul", x, b.op("add", erf, b.scalar(1.0, F32))), b.scalar(0.5, F32))


@rule("gelu-erf-recompose", op("mul", op("mul", X, _erf_part("scaled")), Const("half")),
      "recompose", [example(_gelu_erf_example, (4, 7))])
def gelu_erf_recompose(b, m):
    """x (1 + erf(x / sqrt 2)) 0.5 = gelu(x) (torch.onnx's export of gelu)"""
    _erf_scale(b, m)
    return _gelu(b, m, "none", {"half": 0.5, "one": 1.0})


def _gelu_erf_half_first_example(b, x):
    erf = b.op("erf", b.op("mul", x, b.scalar(1.0 / _SQRT_2, F32)))
    return b.op("mul", b.op("mul", x, b.scalar(0.5, F32)), b.op("add", erf, b.scalar(1.0, F32)))


@rule("gelu-erf-half-first-recompose", op("mul", op("mul", X, Const("half")), _erf_part("scaled")),
      "recompose", [example(_gelu_erf_half_first_example, (4, 7))])
def gelu_erf_half_first_recompose(b, m):
    """x 0.5 (1 + erf(x / sqrt 2)) = gelu(x) (the written-out form in Python models)"""
    _erf_scale(b, m)
    return _gelu(b, m, "none", {"half": 0.5, "one": 1.0})
