"""Views and layout: reshape, permute, expand, slice, cat, split, repeat."""
from __future__ import annotations

import torch

from ...ir import symbols
from ..lowering import Unsupported, lowers
from .common import MAX_INDEX, _dims, _shape, aten

# -- layout ----------------------------------------------------------------------------------
def reshape(ctx, v, shape):
    shape = list(shape)
    if -1 in shape:
        known = 1
        for d in shape:
            known *= d if d != -1 else 1
        shape[shape.index(-1)] = v.type.numel // known if known else 0
    if shape == _shape(v):
        return v
    return ctx.add1("reshape", [v], {"shape": shape})


@lowers(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(ctx, x, shape):
    return reshape(ctx, ctx.value(x), shape)


@lowers(aten.as_strided.default)
def _as_strided(ctx, x, size, stride, storage_offset=None):
    """The one as_strided that is a reshape: over an input laid out contiguously in its
    storage (from its traced metadata), the contiguous layout of `size` with the same
    number of elements (strides of size-1 dims are free). adaptive_avg_pool1d's
    decomposition makes one (Swin's pooler); any other view of storage stays in eager."""
    value = x.meta.get("val") if hasattr(x, "meta") else None
    if not isinstance(value, torch.Tensor) or not value.is_contiguous() \
            or value.storage_offset() != 0 or storage_offset:
        raise Unsupported("as_strided of a tensor not contiguous in its storage")
    expected = 1
    for dim, want in reversed(list(zip(size, stride))):
        if dim != 1 and want != expected:
            raise Unsupported("as_strided to a non-contiguous view")
        expected *= dim
    v = ctx.value(x)
    if expected != v.type.numel:
        raise Unsupported("as_strided to a part of the storage")
    return reshape(ctx, v, size)


@lowers(aten.unsqueeze.default)
def _unsqueeze(ctx, x, dim):
    v = ctx.value(x)
    shape = _shape(v)
    shape.insert(dim % (len(shape) + 1), 1)
    return reshape(ctx, v, shape)


@lowers(aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default)
def _squeeze(ctx, x, dims=None):
    v = ctx.value(x)
    shape = _shape(v)
    dims = _dims(dims, len(shape))
    return reshape(ctx, v, [s for i, s in enumerate(shape) if not (i in dims and s == 1)])


@lowers(aten.permute.default)
def _permute(ctx, x, dims):
    v = ctx.value(x)
    dims = [d % max(v.type.rank, 1) for d in dims]
    if dims == list(range(v.type.rank)):
        return v
    return ctx.add1("permute", [v], {"dims": dims})


@lowers(aten.t.default)
def _t(ctx, x):
    v = ctx.value(x)
    return v if v.type.rank < 2 else ctx.add1("permute", [v], {"dims": [1, 0]})


@lowers(aten.transpose.int)
def _transpose(ctx, x, d0, d1):
    v = ctx.value(x)
    dims = list(range(v.type.rank))
    d0, d1 = d0 % v.type.rank, d1 % v.type.rank
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return _permute(ctx, x, dims)


@lowers(aten.expand.default)
def _expand(ctx, x, size, implicit=False):
    v = ctx.value(x)
    shape, have = list(size), _shape(v)
    offset = len(shape) - len(have)
    shape = [have[i - offset] if d == -1 else d for i, d in enumerate(shape)]
    if shape == have:
        return v
    return ctx.add1("expand", [v], {"shape": shape})


@lowers(aten.repeat.default)
def _repeat(ctx, x, repeats):
    """x.repeat(r): tile each dim r times, as expand over a new axis before each dim, then
    a reshape merging the pairs (leading repeats beyond x's rank add dims)."""
    v = ctx.value(x)
    have = [1] * (len(repeats) - v.type.rank) + _shape(v)
    if len(have) != len(repeats):
        raise Unsupported("repeat with fewer repeats than dims")
    if all(r == 1 for r in repeats):
        return reshape(ctx, v, have)
    spread = reshape(ctx, v, [d for s in have for d in (1, s)])
    tiled = ctx.add1("expand", [spread], {"shape": [d for r, s in zip(repeats, have)
                                                    for d in (r, s)]})
    return reshape(ctx, tiled, [r * s for r, s in zip(repeats, have)])


@lowers(aten.slice_scatter.default)
def _slice_scatter(ctx, base, src, dim=0, start=None, end=None, step=1):
    """`base` with `base[start:end]` along `dim` replaced by `src` (a functionalized slice
    assignment: BART shifting its tokens right), as a cat of the kept parts and `src`."""
    v, new = ctx.value(base), ctx.value(src)
    dim = dim % v.type.rank
    size = v.type.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None or end > size else (end + size if end < 0 else end)
    if step != 1 or new.type.dtype != v.type.dtype or new.type.shape[dim] != end - start:
        raise Unsupported("slice assignment with a step or another dtype")
    parts = []
    if start > 0:
        parts.append(ctx.add1("slice", [v], {"dim": dim, "start": 0, "end": start, "step": 1}))
    parts.append(new)
    if end < size:
        parts.append(ctx.add1("slice", [v], {"dim": dim, "start": end, "end": size, "step": 1}))
    return parts[0] if len(parts) == 1 else ctx.add1("cat", parts, {"dim": dim})


@lowers(aten.copy.default)
def _copy(ctx, dst, src, non_blocking=False):
    """The functional copy: `src`'s values in `dst`'s shape and dtype."""
    v, new = ctx.value(dst), ctx.value(src)
    if new.type.dtype != v.type.dtype:
        new = ctx.add1("cast", [new], {"dtype": v.type.dtype})
    if _shape(new) != _shape(v):
        new = ctx.add1("expand", [new], {"shape": _shape(v)})
    return new


@lowers(aten.slice.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    v = ctx.value(x)
    dim = dim % v.type.rank
    start = 0 if start is None else start
    end = MAX_INDEX if end is None else (min(end, MAX_INDEX) if isinstance(end, int) else end)
    if start == 0 and symbols.provably_at_least(end, v.type.shape[dim]) and step == 1:
        return v
    return ctx.add1("slice", [v], {"dim": dim, "start": start, "end": end, "step": step})


@lowers(aten.split_with_sizes.default)
def _split_with_sizes(ctx, x, sizes, dim=0):
    """Consecutive slices along `dim` (GPT-2 splits its fused q, k, v projection)."""
    v = ctx.value(x)
    dim = dim % v.type.rank
    if sum(sizes) != v.type.shape[dim]:
        raise Unsupported("split sizes that do not add up to the dim")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if len(sizes) == 1:
        return [v]
    return [ctx.add1("slice", [v], {"dim": dim, "start": s, "end": s + n, "step": 1})
            for s, n in zip(starts, sizes)]


@lowers(aten.select.int)
def _select(ctx, x, dim, index):
    v = ctx.value(x)
    dim = dim % v.type.rank
    size = v.type.shape[dim]
    # a symbolic dim: a negative index counts from its end; another is the trace's guarded index
    index = index % size if not symbols.is_symbolic(size) else (index + size if index < 0 else index)
    sliced = ctx.add1("slice", [v], {"dim": dim, "start": index, "end": index + 1, "step": 1})
    return reshape(ctx, sliced, [s for i, s in enumerate(_shape(v)) if i != dim])


@lowers(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    values = [ctx.value(t) for t in tensors]
    # legacy 1-d empties take no part, unless they are all there is (the result is one)
    values = [v for v in values if not (v.type.rank == 1 and v.type.shape[0] == 0)] or values[:1]
    if len(values) == 1:
        return values[0]
    return ctx.add1("cat", values, {"dim": dim % values[0].type.rank})
