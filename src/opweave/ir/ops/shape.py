"""Data-layout ops: reshape (reorganize); permute, expand, slice, cat (shuffle / one-to-many)."""
from __future__ import annotations

import math

import sympy
import torch

from .. import symbols
from ._common import Attr, MappingType, ShapeError, define, norm_dim, same_dtype


def _reshape_shape(ins, attrs):
    shape = tuple(attrs["shape"])
    if any(d < 0 for d in shape):
        raise ShapeError(f"reshape: target shape {list(shape)} must be fully static")
    if math.prod(shape) != ins[0].numel:
        raise ShapeError(f"reshape: cannot view {ins[0]} as {list(shape)}")
    return [shape]


def _reshape(x, shape):
    """Same elements, new shape (a view where the layout allows)."""
    return x.reshape(shape)


define("reshape", 1, MappingType.REORGANIZE, _reshape_shape, same_dtype, _reshape,
       attrs={"shape": Attr("ints")}, is_view=True)


def _permute_shape(ins, attrs):
    dims = [norm_dim(d, ins[0].rank) for d in attrs["dims"]] if ins[0].rank else list(attrs["dims"])
    if sorted(dims) != list(range(ins[0].rank)):
        raise ShapeError(f"permute: {attrs['dims']} is not a permutation of the {ins[0].rank} dims of {ins[0]}")
    return [tuple(ins[0].shape[d] for d in dims)]


def _permute(x, dims):
    """Reorder the dims (a view)."""
    return x.permute(dims)


define("permute", 1, MappingType.SHUFFLE, _permute_shape, same_dtype, _permute,
       attrs={"dims": Attr("ints")}, is_view=True)


def _expand_shape(ins, attrs):
    shape, target = ins[0].shape, tuple(attrs["shape"])
    if len(target) < len(shape):
        raise ShapeError(f"expand: {list(target)} has fewer dims than {ins[0]}")
    for have, want in zip(reversed(shape), reversed(target)):
        if have != want and have != 1:
            raise ShapeError(f"expand: cannot expand {ins[0]} to {list(target)}")
    if any(d < 0 for d in target):
        raise ShapeError(f"expand: target shape {list(target)} must be fully static")
    return [target]


def _expand(x, shape):
    """Broadcast size-1 dims to `shape` (a view)."""
    return x.expand(shape)


define("expand", 1, MappingType.ONE_TO_MANY, _expand_shape, same_dtype, _expand,
       attrs={"shape": Attr("ints")}, is_view=True)


def _slice_shape(ins, attrs):
    shape = list(ins[0].shape)
    dim = norm_dim(attrs["dim"], len(shape))
    if attrs["step"] < 1:
        raise ShapeError(f"slice: step must be positive, got {attrs['step']}")
    size, step = shape[dim], attrs["step"]
    if not symbols.is_symbolic(size) and not symbols.free_symbols([attrs["start"], attrs["end"]]):
        start, end, _ = slice(attrs["start"], attrs["end"], step).indices(size)
        shape[dim] = len(range(start, end, step))
        return [tuple(shape)]
    start, end = _symbolic_bound(attrs["start"], size), _symbolic_bound(attrs["end"], size)
    length = symbols.dim(sympy.floor((end - start + step - 1) / step))
    shape[dim] = 0 if symbols.provably_at_least(0, length) else length
    return [tuple(shape)]


def _symbolic_bound(index, size):
    """A slice bound over a symbolic dim or with a symbolic value, clamped to [0, size]
    where that is decidable; where it is not (a bound `s0` into a dim of 512), it is
    taken to lie inside the dim, as the trace that gave it guarded. That is an assumption
    a specialization checks: its concrete shape rule must give the same length
    (ir.specialize), so a binding outside it raises SymbolError, never a wrong slice."""
    if isinstance(index, int) and index >= 2**62:  # "to the end"
        return size
    if isinstance(index, int) and index < 0:
        index = index + size
    if symbols.provably_at_least(index, size):
        return size
    if sympy.sympify(index).is_negative:
        return 0
    return index


def _slice(x, dim, start, end, step):
    """Elements start:end:step along `dim` (a view)."""
    return torch.ops.aten.slice.Tensor(x, dim, start, end, step)


define("slice", 1, MappingType.SHUFFLE, _slice_shape, same_dtype, _slice,
       attrs={"dim": Attr("int"), "start": Attr("int", 0), "end": Attr("int", 2**63 - 1),
              "step": Attr("int", 1)}, is_view=True)


def _cat_shape(ins, attrs):
    if not ins:
        raise ShapeError("cat needs at least one input")
    first = ins[0]
    dim = norm_dim(attrs["dim"], first.rank)
    for t in ins[1:]:
        if t.rank != first.rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim):
            raise ShapeError(f"cat along dim {dim}: {t} does not match {first}")
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in ins)
    return [tuple(shape)]


def _cat_dtype(ins, attrs):
    dtypes = {t.dtype for t in ins}
    if len(dtypes) != 1:
        raise ShapeError(f"cat inputs must share a dtype, got {sorted(map(str, dtypes))}")
    return [ins[0].dtype]


def _cat(*xs, dim):
    """Concatenate along `dim`."""
    return torch.cat(xs, dim)


define("cat", None, MappingType.SHUFFLE, _cat_shape, _cat_dtype, _cat,
       attrs={"dim": Attr("int")},
       impl_out=lambda ins, a, out: torch.cat(ins, a["dim"], out=out))
