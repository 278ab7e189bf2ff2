"""Indexing: index_select and gather read (one-to-many), scatter and index_put write."""
from __future__ import annotations

import torch

from ._common import Attr, MappingType, ShapeError, define, norm_dim


def _check_index(t, op):
    if t.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"{op}: index must be i64 or i32, got {t}")


def _index_select_shape(ins, attrs):
    x, index = ins
    _check_index(index, "index_select")
    if index.rank != 1:
        raise ShapeError(f"index_select: index must be rank 1, got {index}")
    dim = norm_dim(attrs["dim"], x.rank)
    shape = list(x.shape)
    shape[dim] = index.shape[0]
    return [tuple(shape)]


def _index_select(x, index, dim):
    """Rows (or slices along `dim`) picked by a rank-1 index: embedding lookup. A result
    with no elements reads nothing, so its indices are not checked: `x[index]` (aten.index,
    which lowers to this) does not check them either, and autograd's backward of an
    index_put into an empty tensor relies on that."""
    shape = list(x.shape)
    shape[dim] = index.shape[0]
    if 0 in shape:
        return x.new_empty(shape)
    return torch.index_select(x, dim, index)


def _index_select_out(ins, attrs, out):
    if out.numel():
        torch.index_select(ins[0], attrs["dim"], ins[1], out=out)


define("index_select", 2, MappingType.ONE_TO_MANY, _index_select_shape,
       lambda ins, a: [ins[0].dtype], _index_select, attrs={"dim": Attr("int")},
       impl_out=_index_select_out)


def _gather_shape(ins, attrs):
    x, index = ins
    _check_index(index, "gather")
    if index.rank != x.rank:
        raise ShapeError(f"gather: index {index} must have the rank of {x}")
    norm_dim(attrs["dim"], x.rank)
    return [index.shape]


def _gather(x, index, dim):
    """out[i][j] = x[index[i][j]][j] along `dim`."""
    return torch.gather(x, dim, index)


define("gather", 2, MappingType.ONE_TO_MANY, _gather_shape, lambda ins, a: [ins[0].dtype],
       _gather, attrs={"dim": Attr("int")})


def _scatter_shape(ins, attrs):
    x, index, src = ins
    _check_index(index, "scatter")
    if not (x.rank == index.rank == src.rank):
        raise ShapeError(f"scatter: {x}, index {index} and src {src} must share a rank")
    norm_dim(attrs["dim"], x.rank)
    return [x.shape]


def _scatter(x, index, src, dim):
    """A copy of x with src written at index along `dim`."""
    return torch.scatter(x, dim, index, src)


define("scatter", 3, MappingType.MANY_TO_MANY, _scatter_shape, lambda ins, a: [ins[0].dtype],
       _scatter, attrs={"dim": Attr("int")})


def _index_put_shape(ins, attrs):
    x, index, values = ins
    _check_index(index, "index_put")
    if index.rank != 1:
        raise ShapeError(f"index_put: index must be rank 1, got {index}")
    return [x.shape]


def _index_put(x, index, values, accumulate):
    """A copy of x with x[index] = values (or += with accumulate): embedding backward."""
    return torch.index_put(x, (index,), values, accumulate)


define("index_put", 3, MappingType.MANY_TO_MANY, _index_put_shape, lambda ins, a: [ins[0].dtype],
       _index_put, attrs={"accumulate": Attr("bool", False)})


def _index_add_zeros_shape(ins, attrs):
    index, values = ins
    _check_index(index, "index_add_zeros")
    if index.rank != 1 or values.rank < 1 or values.shape[0] != index.shape[0]:
        raise ShapeError(f"index_add_zeros: needs a rank-1 index and one value row per "
                         f"index, got {index} and {values}")
    return [(attrs["rows"],) + tuple(values.shape[1:])]


def _index_add_zeros(index, values, rows):
    """Zeros with values[i] added into row index[i]: an embedding's weight gradient,
    written in place into a fresh buffer (index_put onto zeros would copy the zeros)."""
    out = torch.zeros((rows,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_put_((index,), values, accumulate=True)


define("index_add_zeros", 2, MappingType.MANY_TO_MANY, _index_add_zeros_shape,
       lambda ins, a: [ins[1].dtype], _index_add_zeros, attrs={"rows": Attr("int")})
