"""Constant folding and identity elimination."""
from __future__ import annotations

from ....ir import registry, symbols
from ._helpers import (F32, Const, X, Y, any_op, attrs_of, example, filled_with, op,
                       rand, require, rule, same, torch)

# Fold an op over constants when its result is no bigger than this or than its inputs:
# folding `expand` of a scalar into a large tensor would cost memory and gain nothing.
FOLD_SMALL = 1 << 16


def _fold_example(b):
    return b.op("matmul", b.const(rand(3, 4)), b.const(rand(4, 3)))


@rule("fold-constants", any_op("n"), "fold", [example(_fold_example)])
def fold_constants(b, m):
    """An op whose inputs are all constants becomes the constant it computes."""
    node = m.node("n")
    opdef = registry.get(node.op)
    require(not opdef.is_random, "random op")
    out = b.type(m.root)
    require(not isinstance(out, tuple), "several outputs")
    require(out.is_static and not symbols.free_symbols(attrs_of(node).values()),
            "symbolic sizes (folding computes the data)")
    names = tuple(b.constant_name(c) for c in node.children)
    require(all(n is not None for n in names), "an input is not constant")
    size = sum(b.type(c).numel for c in node.children)
    require(out.numel <= max(size, FOLD_SMALL), "the result is larger than its inputs")
    key = (node.op, node.attrs, names)
    if node.op == "cat":  # one key for every nesting of the same parts
        dim = node.attr("dim") % out.rank
        parts = tuple(p for n in names for p in b.store.parts(n, dim))
        key = ("cat", dim, parts)
    store, attrs = b.store, attrs_of(node)

    def compute():  # run only if something reads the data (see Store)
        return opdef.impl(*[store.data(n) for n in names], **attrs)
    cid = b.cached_const(key, compute, type_=out)
    if node.op == "cat":
        b.store.cat_parts.setdefault(b.store.fold_names[key], (dim, parts))
    return cid


def _identity(name, pattern, value, doc, build):
    """`pattern` (over X and a constant `c`) is X when c is filled with `value`."""
    @rule(name, pattern, "simplify", [example(build, (2, 3))], doc)
    def rhs(b, m):
        require(filled_with(b, m["c"], value), f"constant is not {value}")
        return same(b, m.root, m["x"])
    return rhs


_c0 = lambda b: b.scalar(0.0, F32)  # noqa: E731
_c1 = lambda b: b.scalar(1.0, F32)  # noqa: E731
_identity("add-zero", op("add", X, Const("c")), 0, "x + 0 = x",
          lambda b, x: b.op("add", x, _c0(b)))
_identity("add-zero-left", op("add", Const("c"), X), 0, "0 + x = x",
          lambda b, x: b.op("add", _c0(b), x))
_identity("sub-zero", op("sub", X, Const("c")), 0, "x - 0 = x",
          lambda b, x: b.op("sub", x, _c0(b)))
_identity("mul-one", op("mul", X, Const("c")), 1, "x * 1 = x",
          lambda b, x: b.op("mul", x, _c1(b)))
_identity("mul-one-left", op("mul", Const("c"), X), 1, "1 * x = x",
          lambda b, x: b.op("mul", _c1(b), x))
_identity("div-one", op("div", X, Const("c"), rounding="none"), 1, "x / 1 = x",
          lambda b, x: b.op("div", x, _c1(b)))
_identity("pow-one", op("pow", X, Const("c")), 1, "x ** 1 = x",
          lambda b, x: b.op("pow", x, _c1(b)))


def _involution(name, op_name, doc):
    @rule(name, op(op_name, op(op_name, X)), "simplify",
          [example(lambda b, x: b.op(op_name, b.op(op_name, x)), (2, 3))], doc)
    def rhs(b, m):
        return m["x"]
    return rhs


_involution("neg-neg", "neg", "-(-x) = x")
_involution("reciprocal-reciprocal", "reciprocal", "1/(1/x) = x (within rounding)")


def _idempotent(name, op_name, doc):
    @rule(name, op(op_name, op(op_name, X, bind="inner")), "simplify",
          [example(lambda b, x: b.op(op_name, b.op(op_name, x)), (2, 3))], doc)
    def rhs(b, m):
        return m["inner"]
    return rhs


_idempotent("relu-relu", "relu", "relu(relu(x)) = relu(x)")
_idempotent("abs-abs", "abs", "|(|x|)| = |x|")


@rule("abs-neg", op("abs", op("neg", X)), "simplify",
      [example(lambda b, x: b.op("abs", b.op("neg", x)), (2, 3))])
def abs_neg(b, m):
    """|-x| = |x|"""
    return b.op("abs", m["x"])


def _self(name, op_name, doc):
    @rule(name, op(op_name, X, X), "simplify",
          [example(lambda b, x: b.op(op_name, x, x), (2, 3))], doc)
    def rhs(b, m):
        return m["x"]
    return rhs


_self("maximum-self", "maximum", "max(x, x) = x")
_self("minimum-self", "minimum", "min(x, x) = x")


@rule("where-same", op("where", Y, X, X), "simplify",
      [example(lambda b, x, c: b.op("where", b.op("gt", c, x), x, x), (2, 3), (2, 3))])
def where_same(b, m):
    """where(c, x, x) = x (when the condition does not broadcast x)"""
    return same(b, m.root, m["x"])


@rule("mul-neg-one", op("mul", X, Const("c")), "simplify",
      [example(lambda b, x: b.op("mul", x, b.scalar(-1.0, F32)), (2, 3))])
def mul_neg_one(b, m):
    """x * -1 = -x"""
    require(filled_with(b, m["c"], -1), "not -1")
    return same(b, m.root, b.op("neg", m["x"]))


def _noop_view(name, op_name, is_noop, build, doc):
    @rule(name, op(op_name, X, bind="v"), "simplify", [example(build, (2, 3, 4))], doc)
    def rhs(b, m):
        require(is_noop(b.type(m["x"]), attrs_of(m.node("v"))), "not a no-op")
        return same(b, m.root, m["x"])
    return rhs


def _full_slice(t, a):
    size = t.shape[a["dim"] % t.rank]
    return a["step"] == 1 and a["start"] in (0, -size) and a["end"] >= size


_noop_view("reshape-noop", "reshape", lambda t, a: tuple(a["shape"]) == t.shape,
           lambda b, x: b.op("reshape", x, shape=[2, 3, 4]), "reshape to its own shape")
_noop_view("permute-noop", "permute", lambda t, a: list(a["dims"]) == list(range(t.rank)),
           lambda b, x: b.op("permute", x, dims=[0, 1, 2]), "permute by the identity")
_noop_view("expand-noop", "expand", lambda t, a: tuple(a["shape"]) == t.shape,
           lambda b, x: b.op("expand", x, shape=[2, 3, 4]), "expand to its own shape")
_noop_view("slice-noop", "slice", _full_slice,
           lambda b, x: b.op("slice", x, dim=1, start=0, end=2**63 - 1), "slice of everything")
_noop_view("cast-noop", "cast", lambda t, a: a["dtype"] == t.dtype,
           lambda b, x: b.op("cast", x, dtype=F32), "cast to its own dtype")


@rule("cat-single", op("cat", X), "simplify", [example(lambda b, x: b.op("cat", x, dim=0), (2, 3))])
def cat_single(b, m):
    """cat of one tensor is that tensor"""
    return same(b, m.root, m["x"])


@rule("dropout-zero", op("get", op("dropout", X, bind="d"), index=0), "simplify",
      [example(lambda b, x: b.get(b.op("dropout", x, p=0.0), 0), (2, 3))])
def dropout_zero(b, m):
    """dropout with p = 0 keeps every element"""
    require(m.node("d").attr("p") == 0, "p is not 0")
    return m["x"]


@rule("clamp-clamp", op("clamp", op("clamp", X, bind="inner"), bind="outer"), "simplify",
      [example(lambda b, x: b.op("clamp", b.op("clamp", x, min=-1.0), max=0.5), (2, 3))])
def clamp_clamp(b, m):
    """clamp(clamp(x, a, b), c, d) = clamp(x, max(a, c), min(b, d)) when the ranges meet"""
    inner, outer = attrs_of(m.node("inner")), attrs_of(m.node("outer"))
    lo = [v for v in (inner["min"], outer["min"]) if v is not None]
    hi = [v for v in (inner["max"], outer["max"]) if v is not None]
    lo_v, hi_v = (max(lo) if lo else None), (min(hi) if hi else None)
    require(lo_v is None or hi_v is None or lo_v <= hi_v, "empty range")
    require(outer["min"] is None or inner["max"] is None or outer["min"] <= inner["max"],
            "ranges do not meet")
    require(outer["max"] is None or inner["min"] is None or outer["max"] >= inner["min"],
            "ranges do not meet")
    return b.op("clamp", m["x"], min=lo_v, max=hi_v)


