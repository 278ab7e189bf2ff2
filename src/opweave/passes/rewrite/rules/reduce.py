"""Reduction elimination (EVT): reductions that the algebra folds away or shrinks.

Training graphs are full of them: the backward of a broadcast is a sum over the
broadcast axes (bias gradients, mean's gradient), and chain-rule factors that are
constant along a reduced axis (layer norm's rstd, a loss scale) multiply inside sums.
- a sum (mean) over axes a value was only broadcast along is a multiplication (a view);
- a factor constant along the reduced axes moves out: the sum reads one tensor, and the
  multiplication runs on the reduced result;
- a sum of a sum is one sum;
- axes of size 1 need no reduction (at batch 1 every sum over the batch axis is a view).
Identical reductions (statistics computed twice) need no rule: the e-graph shares them.
"""
from __future__ import annotations

from ....ir.ops.reduction import column_sum_axes
from ._helpers import X, Y, example, op, require, rule, same


def _reduced(node, t) -> list[int]:
    """The axes a sum reduces (no axes: all of them, as torch.sum)."""
    return sorted({d % t.rank for d in node.attr("dims")}) if node.attr("dims") else list(range(t.rank))


def _kept_shape(shape, dims, keepdim) -> list[int]:
    return [1 if i in dims else s for i, s in enumerate(shape) if keepdim or i not in dims]


def _broadcast_only_along(source_shape, full_shape, dims) -> bool:
    """Whether a value of `source_shape` broadcast to `full_shape` varies only along axes
    outside `dims` (its size there is 1, or the axis is new)."""
    offset = len(full_shape) - len(source_shape)
    for i, size in enumerate(full_shape):
        mine = source_shape[i - offset] if i >= offset else 1
        if i in dims and mine != 1:
            return False
        if i not in dims and mine != size:
            return False
    return True


def _sum_of_expand(b, m, scale_by_count: bool):
    s, e = m.node("s"), m.node("e")
    full = list(e.attr("shape"))
    dims = _reduced(s, b.type(m["e"]))
    source = list(b.type(m["x"]).shape)
    require(b.type(m["x"]).dtype.is_floating_point, "not a float")
    require(_broadcast_only_along(source, full, dims), "the value varies along a reduced axis")
    count = 1
    for d in dims:
        count *= full[d]
    x = m["x"]
    if scale_by_count and count != 1:
        x = b.op("mul", x, b.scalar(float(count), b.type(x).dtype))
    shape = _kept_shape(full, dims, s.attr("keepdim"))
    return same(b, m.root, b.op("reshape", x, shape=shape))


def _expand_example(reduce):
    return lambda b, x: b.op(reduce, b.op("expand", x, shape=[4, 2, 3]), dims=[0], keepdim=False)


@rule("sum-of-broadcast", op("sum", op("expand", X, bind="e"), bind="s"), "reduce",
      [example(_expand_example("sum"), (1, 2, 3)), example(_expand_example("sum"), (2, 3))])
def sum_of_broadcast(b, m):
    """sum over axes x was broadcast along = x times their size"""
    return _sum_of_expand(b, m, scale_by_count=True)


@rule("mean-of-broadcast", op("mean", op("expand", X, bind="e"), bind="s"), "reduce",
      [example(_expand_example("mean"), (1, 2, 3))])
def mean_of_broadcast(b, m):
    """mean over axes x was broadcast along = x"""
    return _sum_of_expand(b, m, scale_by_count=False)


def _scale_out(b, m, factor, other):
    s = m.node("s")
    t = b.type(m["m"])
    dims = _reduced(s, t)
    require(b.type(other).shape == t.shape, "the other operand is broadcast too")
    require(t.dtype.is_floating_point and b.type(factor).dtype == t.dtype, "not one float type")
    require(_broadcast_only_along(list(b.type(factor).shape), list(t.shape), dims)
            if b.type(factor).rank else True, "the factor varies along a reduced axis")
    require(b.type(factor).rank == 0 or s.attr("keepdim"), "the factor would lose its alignment")
    reduced = b.op("sum", other, dims=list(s.attr("dims")), keepdim=s.attr("keepdim"))
    return same(b, m.root, b.op("mul", reduced, factor))


def _scale_example(b, x, y):
    return b.op("sum", b.op("mul", x, y), dims=[1], keepdim=True)


@rule("sum-scale-out-right", op("sum", op("mul", X, Y, bind="m"), bind="s"), "reduce",
      [example(_scale_example, (3, 5), (3, 1)), example(_scale_example, (3, 5), ())])
def sum_scale_out_right(b, m):
    """sum(x c) = sum(x) c, when c is constant along the reduced axes"""
    return _scale_out(b, m, m["y"], m["x"])


@rule("sum-scale-out-left", op("sum", op("mul", Y, X, bind="m"), bind="s"), "reduce",
      [example(lambda b, y, x: _scale_example(b, y, x), (3, 1), (3, 5))])
def sum_scale_out_left(b, m):
    """sum(c x) = sum(x) c, when c is constant along the reduced axes"""
    return _scale_out(b, m, m["y"], m["x"])


def _sum_sum_example(keep_outer):
    return lambda b, x: b.op("sum", b.op("sum", x, dims=[2], keepdim=True), dims=[0, 2],
                             keepdim=keep_outer)


@rule("sum-of-sum", op("sum", op("sum", X, bind="i"), bind="o"), "reduce",
      [example(_sum_sum_example(True), (2, 3, 4)), example(_sum_sum_example(False), (2, 3, 4))])
def sum_of_sum(b, m):
    """sum(sum(x, A, keepdim), B) = sum(x, A + B) when the inner sum keeps its axes
    (and the outer one drops them, if it drops any)"""
    inner, outer = m.node("i"), m.node("o")
    t = b.type(m["x"])
    require(inner.attr("keepdim"), "the inner sum drops axes")
    a, o = set(_reduced(inner, t)), set(_reduced(outer, t))
    keep = outer.attr("keepdim")
    require(keep or a <= o, "the outer sum drops axes but keeps the inner ones")
    return same(b, m.root, b.op("sum", m["x"], dims=sorted(a | o), keepdim=keep))



def _unit_axes_example(reduce, dims, keepdim):
    return lambda b, x: b.op(reduce, x, dims=dims, keepdim=keepdim)


@rule("reduce-unit-axes", op(("sum", "mean", "amax", "amin"), X, bind="s"), "reduce",
      [example(_unit_axes_example("sum", [0], True), (1, 3)),
       example(_unit_axes_example("mean", [0, 1], False), (1, 3, 2)),
       example(_unit_axes_example("amax", [0, 2], True), (1, 3, 1))])
def reduce_unit_axes(b, m):
    """a reduction over an axis of size 1 is a view of it"""
    s, t = m.node("s"), b.type(m["x"])
    dims = _reduced(s, t)
    unit = [d for d in dims if t.shape[d] == 1]
    require(t.rank > 0 and unit, "no axis of size 1 is reduced")
    rest = [d for d in dims if d not in unit]
    keep = s.attr("keepdim")
    x = m["x"]
    if rest:  # the real reduction, keeping axes so the view below can drop them
        x = b.op(s.op, x, dims=rest, keepdim=True)
    return same(b, m.root, b.op("reshape", x, shape=_kept_shape(list(t.shape), dims, keep)))


def _through_reshape_example(keepdim):
    return lambda b, x: b.op("sum", b.op("reshape", x, shape=[6, 4]), dims=[0], keepdim=keepdim)


@rule("sum-through-reshape", op("sum", op("reshape", X, bind="r"), bind="s"), "reduce",
      [example(_through_reshape_example(False), (2, 3, 4)),
       example(_through_reshape_example(True), (1, 6, 4))])
def sum_through_reshape(b, m):
    """the column sums of a reshape that keeps the last axis are the column sums of its
    input: the sum then reads the tensor its producer wrote, and can fuse with it"""
    s, t = m.node("s"), b.type(m["x"])
    viewed = b.type(m["r"])
    require(t.rank >= 2 and viewed.rank >= 1 and t.shape[-1] == viewed.shape[-1],
            "the reshape moves the last axis")
    require(column_sum_axes(list(viewed.shape), _reduced(s, viewed)), "not a column sum")
    total = b.op("sum", m["x"], dims=list(range(t.rank - 1)), keepdim=False)
    out = b.type(m.root).shape
    return same(b, m.root, total if list(out) == [t.shape[-1]]
                else b.op("reshape", total, shape=list(out)))
