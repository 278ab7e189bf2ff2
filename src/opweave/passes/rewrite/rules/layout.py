"""Layout: compose and cancel views, and move views past elementwise ops."""
from __future__ import annotations

from ._helpers import (F32, Const, X, Y, attrs_of, example, filled_with, op, op_any_arity,
                       require, rule, same, scalar_of)


@rule("permute-permute", op("permute", op("permute", X, bind="p"), bind="q"), "layout",
      [example(lambda b, x: b.op("permute", b.op("permute", x, dims=[1, 2, 0]), dims=[2, 0, 1]),
               (2, 3, 4)),
       example(lambda b, x: b.op("permute", b.op("permute", x, dims=[0, 2, 1, 3]),
                                 dims=[0, 1, 3, 2]), (2, 3, 4, 5))])
def permute_permute(b, m):
    """Two permutations are one: dims[j] = p[q[j]]."""
    p, q = m.node("p").attr("dims"), m.node("q").attr("dims")
    return b.op("permute", m["x"], dims=[p[j] for j in q])


@rule("reshape-reshape", op("reshape", op("reshape", X), bind="r"), "layout",
      [example(lambda b, x: b.op("reshape", b.op("reshape", x, shape=[6, 4]), shape=[2, 12]),
               (2, 3, 4))])
def reshape_reshape(b, m):
    """A reshape of a reshape is one reshape (both keep row-major order)."""
    return b.op("reshape", m["x"], shape=list(m.node("r").attr("shape")))


@rule("slice-slice", op("slice", op("slice", X, bind="inner"), bind="outer"), "layout",
      [example(lambda b, x: b.op("slice", b.op("slice", x, dim=1, start=1, end=9, step=2),
                                 dim=1, start=1, end=3), (2, 10)),
       example(lambda b, x: b.op("slice", b.op("slice", x, dim=0, start=-7, end=9),
                                 dim=0, start=1, end=-1, step=3), (10, 2))])
def slice_slice(b, m):
    """Slices along one dim compose: Python's range slicing gives start, end and step."""
    inner, outer = attrs_of(m.node("inner")), attrs_of(m.node("outer"))
    t = b.type(m["x"])
    dim = inner["dim"] % t.rank
    require(outer["dim"] % t.rank == dim, "different dims")
    r = range(t.shape[dim])[inner["start"]:inner["end"]:inner["step"]]
    r = r[outer["start"]:outer["end"]:outer["step"]]
    require(len(r) > 0, "empty slice")
    return b.op("slice", m["x"], dim=dim, start=r.start, end=r[-1] + 1, step=r.step)


@rule("slice-of-cat", op("slice", op_any_arity("cat", "cat"), bind="s"), "layout",
      [example(lambda b, x, y: b.op("slice", b.op("cat", x, y, dim=1), dim=1, start=3, end=5),
               (2, 3), (2, 4))])
def slice_of_cat(b, m):
    """A unit-step slice inside one operand of a cat is a slice of that operand."""
    s, cat = attrs_of(m.node("s")), m.node("cat")
    out = b.type(m.root)
    dim = s["dim"] % out.rank
    require(cat.attr("dim") % out.rank == dim and s["step"] == 1, "other dim or step")
    total = sum(b.type(c).shape[dim] for c in cat.children)
    r = range(total)[s["start"]:s["end"]]
    offset = 0
    for child in cat.children:
        size = b.type(child).shape[dim]
        if offset <= r.start and r.stop <= offset + size and len(r):
            return b.op("slice", child, dim=dim, start=r.start - offset, end=r.stop - offset)
        offset += size
    return require(False, "the slice spans operands")


@rule("cat-of-slices", op("cat", op("slice", X, bind="a"), op("slice", X, bind="b"), bind="c"),
      "layout",
      [example(lambda b, x: b.op("cat", b.op("slice", x, dim=1, start=1, end=3),
                                 b.op("slice", x, dim=1, start=3, end=6), dim=1), (2, 8))])
def cat_of_slices(b, m):
    """Adjacent unit-step slices of one tensor, concatenated, are one slice."""
    sa, sb = attrs_of(m.node("a")), attrs_of(m.node("b"))
    t = b.type(m["x"])
    dim = m.node("c").attr("dim") % t.rank
    require(sa["dim"] % t.rank == dim == sb["dim"] % t.rank, "other dims")
    require(sa["step"] == sb["step"] == 1, "steps")
    ra = range(t.shape[dim])[sa["start"]:sa["end"]]
    rb = range(t.shape[dim])[sb["start"]:sb["end"]]
    require(len(ra) > 0 and len(rb) > 0 and ra.stop == rb.start, "not adjacent")
    return b.op("slice", m["x"], dim=dim, start=ra.start, end=rb.stop)


@rule("permute-to-reshape", op("permute", X, bind="p"), "layout",
      [example(lambda b, x: b.op("permute", x, dims=[1, 0, 2]), (1, 3, 4))])
def permute_to_reshape(b, m):
    """A permutation that only moves size-1 dims keeps the element order: a reshape."""
    t = b.type(m["x"])
    dims = m.node("p").attr("dims")
    moved = [d for d in dims if t.shape[d] != 1]
    require(moved == sorted(moved) and list(dims) != list(range(t.rank)), "reorders data")
    return b.op("reshape", m["x"], shape=list(b.type(m.root).shape))


def _swap_last(rank: int) -> list[int]:
    return list(range(rank - 2)) + [rank - 1, rank - 2]


@rule("transpose-of-matmul", op("permute", op("matmul", X, Y), bind="p"), "layout",
      [example(lambda b, x, y: b.op("permute", b.op("matmul", x, y), dims=[1, 0]), (3, 4), (4, 5)),
       example(lambda b, x, y: b.op("permute", b.op("matmul", x, y), dims=[0, 2, 1]),
               (2, 3, 4), (2, 4, 5))])
def transpose_of_matmul(b, m):
    """(A B)^T = B^T A^T (same batch dims on both sides)."""
    ta, tb = b.type(m["x"]), b.type(m["y"])
    require(ta.rank == tb.rank and ta.shape[:-2] == tb.shape[:-2], "broadcast batch dims")
    swap = _swap_last(ta.rank)
    require(list(m.node("p").attr("dims")) == swap, "not a transpose of the last two dims")
    return b.op("matmul", b.op("permute", m["y"], dims=swap), b.op("permute", m["x"], dims=swap))


@rule("matmul-of-transposes", op("matmul", op("permute", X, bind="p"), op("permute", Y, bind="q")),
      "layout",
      [example(lambda b, x, y: b.op("matmul", b.op("permute", x, dims=[1, 0]),
                                    b.op("permute", y, dims=[1, 0])), (4, 3), (5, 4))])
def matmul_of_transposes(b, m):
    """B^T A^T = (A B)^T."""
    ta, tb = b.type(m["x"]), b.type(m["y"])
    require(ta.rank == tb.rank and ta.shape[:-2] == tb.shape[:-2], "broadcast batch dims")
    swap = _swap_last(ta.rank)
    require(list(m.node("p").attr("dims")) == swap == list(m.node("q").attr("dims")), "not transposes")
    return b.op("permute", b.op("matmul", m["y"], m["x"]), dims=swap)


# Elementwise unary ops commute with any view: u(view(x)) = view(u(x)).
_UNARY = ("relu", "gelu", "exp", "neg", "tanh")
_VIEWS = {"permute": {"dims": [2, 0, 1]}, "reshape": {"shape": [6, 4]}}


def _unary_through_view(unary: str, view: str):
    attrs = _VIEWS[view]

    @rule(f"{unary}-through-{view}", op(unary, op(view, X, bind="v"), bind="u"), "layout",
          [example(lambda b, x: b.op(unary, b.op(view, x, **attrs)), (2, 3, 4))],
          f"{unary}({view}(x)) = {view}({unary}(x))")
    def rhs(b, m):
        inner = b.op(unary, m["x"], **attrs_of(m.node("u")))
        return b.op(view, inner, **attrs_of(m.node("v")))
    return rhs


for _u in _UNARY:
    for _v in _VIEWS:
        _unary_through_view(_u, _v)


def _scalar_through_view(binary: str, view: str):
    attrs = _VIEWS[view]

    @rule(f"scalar-{binary}-through-{view}", op(binary, op(view, X, bind="v"), Const("c"), bind="o"),
          "layout",
          [example(lambda b, x: b.op(binary, b.op(view, x, **attrs), b.scalar(0.5, F32)), (2, 3, 4))],
          f"{binary}({view}(x), scalar) = {view}({binary}(x, scalar))")
    def rhs(b, m):
        scalar_of(b, m["c"])
        require(b.type(m["c"]).rank == 0, "not 0-d")
        inner = b.op(binary, m["x"], m["c"], **attrs_of(m.node("o")))
        return same(b, m.root, b.op(view, inner, **attrs_of(m.node("v"))))
    return rhs


for _b in ("mul", "add", "div"):
    for _v in _VIEWS:
        _scalar_through_view(_b, _v)


def _binary_both_permuted(binary: str):
    @rule(f"{binary}-of-permutes", op(binary, op("permute", X, bind="p"), op("permute", Y, bind="q")),
          "layout",
          [example(lambda b, x, y: b.op(binary, b.op("permute", x, dims=[1, 0]),
                                        b.op("permute", y, dims=[1, 0])), (2, 3), (2, 3))],
          f"{binary}(permute(x), permute(y)) = permute({binary}(x, y)), same permutation")
    def rhs(b, m):
        dims = m.node("p").attr("dims")
        require(dims == m.node("q").attr("dims"), "different permutations")
        require(b.type(m["x"]).shape == b.type(m["y"]).shape, "broadcasting")
        return b.op("permute", b.op(binary, m["x"], m["y"]), dims=list(dims))
    return rhs


for _b in ("add", "mul"):
    _binary_both_permuted(_b)


# Zero padding written out before a convolution (TensorFlow's "SAME" padding in ported
# models: a pad, which the frontend spells as a cat of zero blocks, then a convolution
# without padding) is the convolution's own padding when it is the same on both sides.
# Unfolded, the cat copies the activation in its logical (row-major) layout, and the
# convolution after it then reads a tensor that is not channels-last.
def _zero_block(b, cid: int) -> bool:
    """Whether class `cid` is all zeros: a `full` of 0, or a small constant of zeros."""
    return any(e.op == "full" and e.attrs_get("value") == 0 for e in b.view.enodes(cid)) \
        or filled_with(b, cid, 0)


def _peel_zero_padding(b, cid: int, spatial: range, pads: dict) -> int:
    """The class inside nested cats that pad `cid` with equal zero blocks on both sides of
    spatial dims (recorded in `pads`: dim -> count a side); `cid` itself if none do."""
    for e in b.view.enodes(cid):
        if e.op != "cat" or len(e.children) != 3:
            continue
        before, inner, after = e.children
        rank = b.type(cid).rank
        dim = e.attr("dim") % rank
        count = b.type(before).shape[dim]
        if dim in spatial and dim not in pads and count == b.type(after).shape[dim] \
                and _zero_block(b, before) and _zero_block(b, after):
            pads[dim] = count
            return _peel_zero_padding(b, inner, spatial, pads)
    return cid


def _pad_conv_example(b, x, w):
    padded = b.op("cat", b.op("full", shape=[1, 2, 5, 1], value=0.0, dtype=F32), x,
                  b.op("full", shape=[1, 2, 5, 1], value=0.0, dtype=F32), dim=3)
    padded = b.op("cat", b.op("full", shape=[1, 2, 1, 7], value=0.0, dtype=F32), padded,
                  b.op("full", shape=[1, 2, 1, 7], value=0.0, dtype=F32), dim=2)
    return b.op("conv", padded, w, stride=[2, 1], padding=[0, 1], dilation=[1, 1], groups=1)


@rule("zero-pad-into-conv", op_any_arity("conv", "conv"), "layout",
      [example(_pad_conv_example, (1, 2, 5, 5), (3, 2, 3, 3))])
def zero_pad_into_conv(b, m):
    """conv(pad(x, zeros, p on each side)) = conv(x) with p more padding"""
    conv = m.node("conv")
    x, *rest = conv.children
    rank = b.type(x).rank
    pads: dict = {}
    inner = _peel_zero_padding(b, x, range(2, rank), pads)
    require(bool(pads), "no equal zero padding")
    attrs = attrs_of(conv)
    attrs["padding"] = [p + pads.get(2 + i, 0) for i, p in enumerate(attrs["padding"])]
    return same(b, m.root, b.op("conv", inner, *rest, **attrs))
