"""Max pooling, dropout, embedding and indexing (index_select, index, index_put, gather, scatter)."""
from __future__ import annotations

import math
import operator

import torch

from ..lowering import Unsupported, lowers
from .common import _pair, _shape, aten
from .layout import reshape

# -- pooling, dropout, indexing ------------------------------------------------------------------
def _uses_output(index: int, node) -> bool:
    return any(u.target is operator.getitem and u.args[1] == index for u in node.users)



@lowers(aten.max_pool2d_with_indices.default)
def _max_pool2d(ctx, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    kernel = _pair(kernel)
    with_indices = _uses_output(1, ctx.node)
    attrs = {"kernel": kernel, "stride": _pair(stride, kernel),
             "padding": _pair(padding if isinstance(padding, (list, tuple)) else [padding]),
             "dilation": _pair(dilation if isinstance(dilation, (list, tuple)) else [dilation]),
             "ceil_mode": ceil_mode, "with_indices": with_indices}
    outs = ctx.add("max_pool2d", [ctx.value(x)], attrs)
    return outs if with_indices else [outs[0], None]


@lowers(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(ctx, grad, x, kernel, stride, padding, dilation, ceil_mode, indices):
    kernel = _pair(kernel)
    return ctx.add1("max_pool2d_backward", [ctx.value(grad), ctx.value(x), ctx.value(indices)],
                    {"kernel": kernel, "stride": _pair(stride, kernel), "padding": _pair(padding),
                     "dilation": _pair(dilation), "ceil_mode": ceil_mode})


@lowers(aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(ctx, x, output_size):
    with_indices = _uses_output(1, ctx.node)
    outs = ctx.add("adaptive_max_pool2d", [ctx.value(x)],
                   {"output_size": _pair(output_size), "with_indices": with_indices})
    return outs if with_indices else [outs[0], None]


@lowers(aten.adaptive_max_pool2d_backward.default)
def _adaptive_max_pool2d_backward(ctx, grad, x, indices):
    return ctx.add1("adaptive_max_pool2d_backward",
                    [ctx.value(grad), ctx.value(x), ctx.value(indices)])


@lowers(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    v = ctx.value(x)
    if train is False or p == 0:
        return [v, ctx.add1("full", [], {"shape": _shape(v), "value": True, "dtype": torch.bool})]
    return ctx.add("dropout", [v], {"p": p})


@lowers(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    w, idx = ctx.value(weight), ctx.value(indices)
    flat = reshape(ctx, idx, [idx.type.numel])
    rows = ctx.add1("index_select", [w, flat], {"dim": 0})
    return reshape(ctx, rows, _shape(idx) + [w.type.shape[1]])


@lowers(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    v = ctx.value(x)
    return ctx.add1("index_select", [v, ctx.value(index)], {"dim": dim % v.type.rank})


@lowers(aten.index.Tensor)
def _index(ctx, x, indices):
    """x[..., idx, ...] with one integer index tensor (any rank) at one dim, or with
    several at adjacent dims (see `_multi_index`)."""
    v = ctx.value(x)
    if sum(t is not None for t in indices) > 1:
        return _multi_index(ctx, v, indices)
    dim, index = _single_index(ctx, indices)
    flat = _wrapped(ctx, reshape(ctx, index, [index.type.numel]), v.type.shape[dim])
    picked = ctx.add1("index_select", [v, flat], {"dim": dim})
    shape = _shape(v)
    return reshape(ctx, picked, shape[:dim] + _shape(index) + shape[dim + 1:])


def _wrapped(ctx, index, size: int):
    """Negative indices count from the end, as `x[idx]` allows (index_select does not):
    where(idx < 0, idx + size, idx). Out-of-range ones still fail in index_select."""
    negative = ctx.add1("lt", [index, ctx.scalar(0, index)])
    shifted = ctx.add1("add", [index, ctx.scalar(size, index)])
    return ctx.add1("where", [negative, shifted, index])


def _multi_index(ctx, v, indices):
    """x[..., i, j, ...] with integer index tensors at adjacent dims (transformers' masks
    read `padding_mask[batch_idx, kv_idx]`): the indices broadcast together, wrap when
    negative, and combine into one row-major index into those dims flattened, which one
    index_select reads."""
    shape = _shape(v)
    first, count = _adjacent(indices)
    linear, broadcast = _linear_index(ctx, shape, indices, first)
    rows = math.prod(shape[first:first + count])
    flat = reshape(ctx, v, shape[:first] + [rows] + shape[first + count:])
    picked = ctx.add1("index_select", [flat, reshape(ctx, linear, [math.prod(broadcast)])],
                      {"dim": first})
    return reshape(ctx, picked, shape[:first] + broadcast + shape[first + count:])


def _adjacent(indices) -> tuple[int, int]:
    """The first dim and the number of the (adjacent) dims integer index tensors index."""
    present = [d for d, t in enumerate(indices) if t is not None]
    first, count = present[0], len(present)
    if present != list(range(first, first + count)):
        raise Unsupported("advanced indexing with index tensors at dims that are not adjacent")
    return first, count


def _linear_index(ctx, shape, indices, start: int):
    """The row-major index into dims `start`.. of the indexed ones of `shape` flattened,
    for the index tensors in `indices` (adjacent, wrapped when negative) and, for each
    dim from `start` before them, every position along it; and its (broadcast) shape."""
    first, count = _adjacent(indices)
    values = [ctx.value(indices[d]) for d in range(first, first + count)]
    if any(i.type.dtype not in (torch.int64, torch.int32) for i in values):
        raise Unsupported("advanced indexing other than by integer indices")
    broadcast = list(torch.broadcast_shapes(*(tuple(_shape(i)) for i in values)))
    sizes = shape[start:first + count]
    strides = _row_strides(sizes)
    linear = None
    for d in range(start, first):  # every position of a leading dim, along its own axis
        ahead = [1] * (d - start) + [shape[d]] + [1] * (first - d - 1 + len(broadcast))
        position = ctx.add1("arange", [], {"start": 0, "end": shape[d], "step": 1,
                                           "dtype": torch.int64})
        position = reshape(ctx, position, ahead)
        if strides[d - start] != 1:
            position = ctx.add1("mul", [position, ctx.scalar(strides[d - start], position)])
        linear = position if linear is None else ctx.add1("add", [linear, position])
    for i, size, stride in zip(values, shape[first:first + count], strides[first - start:]):
        if i.type.dtype != torch.int64:
            i = ctx.add1("cast", [i], {"dtype": torch.int64})
        i = _wrapped(ctx, i, size)
        if stride != 1:
            i = ctx.add1("mul", [i, ctx.scalar(stride, i)])
        linear = i if linear is None else ctx.add1("add", [linear, i])
    full = shape[start:first] + broadcast
    if _shape(linear) != full:
        linear = ctx.add1("expand", [linear], {"shape": full})
    return linear, full


def _row_strides(sizes):
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return strides[::-1]


def _single_index(ctx, indices):
    present = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(present) != 1:
        raise Unsupported("advanced indexing with more than one index tensor")
    dim, node = present[0]
    index = ctx.value(node)
    if index.type.dtype not in (torch.int64, torch.int32):
        raise Unsupported("advanced indexing other than by an integer index")
    return dim, index


@lowers(aten.index_put.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    """x[idx] = values (or +=) with one integer index tensor on dim 0 (embedding
    backward), or with index tensors at adjacent dims: then the dims up to the last
    indexed one are flattened and indexed by one row-major index (`_linear_index`: the
    gradient of a read at a row and a column index, `x[:, :, rows, cols]`)."""
    v = ctx.value(x)
    shape = _shape(v)
    if sum(t is not None for t in indices) == 1 and indices[0] is not None:
        index = ctx.value(indices[0])
        if index.type.dtype not in (torch.int64, torch.int32):
            raise Unsupported("advanced indexing other than by an integer index")
        rows, flat_shape = _shape(index), shape
    else:
        index, rows = _linear_index(ctx, shape, indices, 0)
        first, indexed = _adjacent(indices)
        flat_shape = [math.prod(shape[:first + indexed])] + shape[first + indexed:]
    count = math.prod(rows)
    vals = ctx.value(values)
    if _shape(vals) != rows + flat_shape[1:]:
        vals = ctx.add1("expand", [vals], {"shape": rows + flat_shape[1:]})
    vals = reshape(ctx, vals, [count] + flat_shape[1:])
    flat = reshape(ctx, index, [count])
    if accumulate and _is_zeros(x) and vals.type.dtype == v.type.dtype:
        out = ctx.add1("index_add_zeros", [flat, vals], {"rows": flat_shape[0]})
    else:
        out = ctx.add1("index_put", [reshape(ctx, v, flat_shape), flat, vals],
                       {"accumulate": accumulate})
    return reshape(ctx, out, shape)


def _is_zeros(node) -> bool:
    """Whether an FX value is a fresh tensor of zeros (`full(shape, 0)`, `zeros`)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.new_zeros.default):
        return True
    return node.target is aten.full.default and node.args[1] == 0


@lowers(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    v = ctx.value(x)
    return ctx.add1("gather", [v, ctx.value(index)], {"dim": dim % v.type.rank})


@lowers(aten.scatter.value, aten.scatter.src)
def _scatter(ctx, x, dim, index, src):
    v, idx = ctx.value(x), ctx.value(index)
    if hasattr(src, "op"):
        s = ctx.value(src)
    else:
        s = ctx.add1("full", [], {"shape": _shape(idx), "value": src, "dtype": v.type.dtype})
    return ctx.add1("scatter", [v, idx, s], {"dim": dim % v.type.rank})
