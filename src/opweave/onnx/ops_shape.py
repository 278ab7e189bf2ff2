"""ONNX operators -> IR ops: shapes, constants and indexing (see `ops_math` for the
handler conventions). Shape-like inputs must be known at import time (`Lowering.ints`):
as constants, or as sizes over the model's symbolic dims (`Lowering.symbolic_value`)."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..ir import padding, symbols
from .errors import where
from .importer import handles
from .ops_math import axis_of, refuse


# -- shapes ----------------------------------------------------------------------------------

@handles("Shape")
def _shape(low, node, ins, attrs):
    shape = list(ins[0].type.shape)
    rank = len(shape)
    start = attrs.get("start", 0)
    end = attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return [low.symbolic_value(np.array(shape[start:end], dtype=object).reshape(-1), "shape")]


@handles("Size")
def _size(low, node, ins, attrs):
    return [low.symbolic_value(np.array(ins[0].type.numel, dtype=object), "size")]


@handles("Constant")
def _constant(low, node, ins, attrs):
    from .importer import tensor_from_proto

    if "value" in attrs:
        return [low.constant(tensor_from_proto(attrs["value"], where(node)), "const")]
    for key, dtype in (("value_float", torch.float32), ("value_floats", torch.float32),
                       ("value_int", torch.int64), ("value_ints", torch.int64)):
        if key in attrs:
            return [low.constant(torch.tensor(attrs[key], dtype=dtype), "const")]
    refuse(low, f"constant kind {sorted(attrs)}")


@handles("ConstantOfShape")
def _constant_of_shape(low, node, ins, attrs):
    from .importer import tensor_from_proto

    shape = low.ints(ins[0], "the shape")
    fill = tensor_from_proto(attrs["value"], where(node)) if "value" in attrs \
        else torch.zeros(1, dtype=torch.float32)
    return [low.emit1("full", [], {"shape": shape, "value": fill.reshape(-1)[0].item(),
                                   "dtype": fill.dtype})]


@handles("Range")
def _range(low, node, ins, attrs):
    if any(v in low.symbolic for v in ins):  # a bound over symbols: an arange node
        if ins[0].type.dtype not in (torch.int64, torch.int32):
            refuse(low, f"a symbolic Range of {ins[0].type.dtype}")
        start, limit, delta = (low.ints(v, "Range bounds")[0] for v in ins)
        if delta == 0:
            refuse(low, "delta of zero")
        return [low.emit1("arange", [], {"start": start, "end": limit, "step": delta,
                                         "dtype": ins[0].type.dtype})]
    start, limit, delta = (low.require_const(v, "Range bounds") for v in ins)
    if delta.item() == 0:
        refuse(low, "delta of zero")
    count = max(math.ceil((limit.item() - start.item()) / delta.item()), 0)
    values = start + delta * torch.arange(count, dtype=start.dtype)
    return [low.constant(values.to(start.dtype), "range")]


@handles("Reshape")
def _reshape(low, node, ins, attrs):
    x = ins[0]
    target = low.ints(ins[1], "the target shape")
    allowzero = attrs.get("allowzero", 0)
    if not allowzero and any(d == 0 and i >= x.type.rank for i, d in enumerate(target)):
        refuse(low, f"target shape {target} copies a dim (0) the input of rank {x.type.rank} lacks")
    shape = [x.type.shape[i] if (d == 0 and not allowzero) else d for i, d in enumerate(target)]
    if shape.count(-1) > 1:
        refuse(low, f"target shape {target} has several -1")
    if -1 in shape:
        known = symbols.product(d for d in shape if d != -1)
        if known == 0:
            refuse(low, f"cannot infer -1 in {target} with a zero-size dim")
        shape[shape.index(-1)] = x.type.numel // known
    return [low.emit1("reshape", [x], {"shape": shape})]


@handles("Flatten")
def _flatten(low, node, ins, attrs):
    x = ins[0]
    rank = x.type.rank
    axis = attrs.get("axis", 1)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis <= rank:
        refuse(low, f"axis {attrs.get('axis')} out of range")
    shape = [math.prod(x.type.shape[:axis]), math.prod(x.type.shape[axis:])]
    return [low.emit1("reshape", [x], {"shape": shape})]


@handles("Squeeze", "Unsqueeze")
def _squeeze(low, node, ins, attrs):
    x = ins[0]
    axes = low.ints(ins[1], "axes") if len(ins) > 1 and ins[1] is not None \
        else list(attrs.get("axes", []))
    shape = list(x.type.shape)
    if node.op_type == "Squeeze":
        dims = {axis_of(low, a, len(shape)) for a in axes} if axes else \
            {i for i, d in enumerate(shape) if d == 1}
        if any(shape[d] != 1 for d in dims):
            refuse(low, f"squeezing a dim that is not 1 (axes {axes} of {shape})")
        new = [d for i, d in enumerate(shape) if i not in dims]
    else:
        rank = len(shape) + len(axes)
        dims = sorted(axis_of(low, a, rank) for a in axes)
        if len(set(dims)) != len(dims):
            refuse(low, f"repeated axes {axes}")
        new, it = [], iter(shape)
        for i in range(rank):
            new.append(1 if i in dims else next(it))
    return [low.emit1("reshape", [x], {"shape": new})]


@handles("Transpose")
def _transpose(low, node, ins, attrs):
    rank = ins[0].type.rank
    perm = list(attrs.get("perm", reversed(range(rank))))
    return [low.emit1("permute", [ins[0]], {"dims": perm})]


@handles("Expand")
def _expand(low, node, ins, attrs):
    x = ins[0]
    target = low.ints(ins[1], "the shape")
    rank = max(len(target), x.type.rank)
    a = [1] * (rank - x.type.rank) + list(x.type.shape)
    b = [1] * (rank - len(target)) + target
    out = []
    for p, q in zip(a, b):
        if p != q and 1 not in (p, q):
            refuse(low, f"cannot broadcast {list(x.type.shape)} to {target}")
        out.append(q if p == 1 else p)
    return [low.emit1("expand", [x], {"shape": out})]


@handles("Concat")
def _concat(low, node, ins, attrs):
    values = [v for v in ins if v is not None]
    axis = axis_of(low, attrs["axis"], values[0].type.rank)
    if len(values) == 1:
        return [values[0]]
    return [low.emit1("cat", values, {"dim": axis})]


@handles("Split")
def _split(low, node, ins, attrs):
    x = ins[0]
    axis = axis_of(low, attrs.get("axis", 0), x.type.rank)
    size = x.type.shape[axis]
    count = len(node.output)
    if len(ins) > 1 and ins[1] is not None:
        sizes = low.ints(ins[1], "split sizes")
    elif "split" in attrs:
        sizes = list(attrs["split"])
    else:
        n = attrs.get("num_outputs", count)
        chunk = -(-size // n)
        sizes = [min(chunk, size - i * chunk) for i in range(n)]
    if sum(sizes) != size or len(sizes) != count:
        refuse(low, f"split sizes {sizes} do not cover dim {axis} of size {size} in {count} parts")
    outs, start = [], 0
    for s in sizes:
        outs.append(low.emit1("slice", [x], {"dim": axis, "start": start, "end": start + s, "step": 1}))
        start += s
    return outs


@handles("Slice")
def _slice(low, node, ins, attrs):
    x = ins[0]
    starts = low.ints(ins[1], "starts")
    ends = low.ints(ins[2], "ends")
    rank = x.type.rank
    axes = low.ints(ins[3], "axes") if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = low.ints(ins[4], "steps") if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if symbols.is_symbolic(step) or step == 0:
            refuse(low, "zero or symbolic steps")
        dim = axis_of(low, axis, rank)
        size = x.type.shape[dim]
        if step < 0:
            x = _slice_backwards(low, x, dim, start, end, step)
            continue
        if symbols.free_symbols([start, end, size]):  # the IR's rule clamps what it can
            x = low.emit1("slice", [x], {"dim": dim, "start": start, "end": end, "step": step})
            continue
        start = min(max(start + size if start < 0 else start, 0), size)
        end = min(max(end + size if end < 0 else end, 0), size)
        end = max(end, start)
        x = low.emit1("slice", [x], {"dim": dim, "start": start, "end": end, "step": step})
    return [x]


@handles("Pad")
def _pad(low, node, ins, attrs):
    """Constant padding as the IR's cat with constant blocks (which a following
    convolution takes as its own padding); reflect, edge and wrap as an index_select of
    source positions. Negative counts crop."""
    x = ins[0]
    mode = attrs.get("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in padding.MODES:
        refuse(low, f"mode={mode!r}")
    counts = low.ints(ins[1], "pads")
    rank = x.type.rank
    axes = low.ints(ins[3], "axes") if len(ins) > 3 and ins[3] is not None else list(range(rank))
    if len(counts) != 2 * len(axes):
        refuse(low, f"{len(counts)} pads for {len(axes)} axes")
    if symbols.free_symbols(list(counts)):
        refuse(low, f"pads known only per call {counts}")
    dims = [axis_of(low, a, rank) for a in axes]
    if len(set(dims)) != len(dims):
        refuse(low, f"repeated axes {axes}")
    value = 0
    if len(ins) > 2 and ins[2] is not None:
        known = low.require_const(ins[2], "constant_value")
        if known.numel() != 1:
            refuse(low, f"a constant_value of {known.numel()} elements")
        value = known.item()
    by_dim = {d: (counts[i], counts[i + len(dims)]) for i, d in enumerate(dims)}
    try:
        return [padding.pad(low.emit1, x, by_dim, mode, value,
                            constant=lambda t: low.constant(t, "pad_positions"))]
    except ValueError as error:
        refuse(low, str(error))


def _slice_backwards(low, x, dim: int, start, end, step: int):
    """A negative step (torch.onnx reverses its pad list so) as an index_select of the
    positions it visits: from start (clamped into the dim) down to, not including, end
    (clamped to one before the first element)."""
    size = x.type.shape[dim]
    if symbols.free_symbols([start, end, size]):
        refuse(low, "a negative step over sizes known only per call")
    start = min(max(start + size if start < 0 else start, 0), size - 1)
    end = min(max(end + size if end < 0 else end, -1), size - 1)
    positions = torch.tensor(list(range(start, end, step)) if size else [], dtype=torch.int64)
    return low.emit1("index_select", [x, low.constant(positions, "slice_positions")],
                     {"dim": dim})


def _normalized_indices(low, indices, size: int):
    """ONNX indices may be negative (counting from the end)."""
    if indices.type.dtype not in (torch.int64, torch.int32):
        refuse(low, f"indices of type {indices.type.dtype}")
    if indices.type.dtype != torch.int64:
        indices = low.emit1("cast", [indices], {"dtype": torch.int64})
    known = low.const_of(indices)
    if known is not None and symbols.is_symbolic(size):
        if known.numel() and known.min() < 0:  # counted from an end known only per call
            refuse(low, f"negative indices into a dim of symbolic size {size}")
        return indices  # past the end, the kernel raises (torch checks its indices)
    if known is not None:
        if known.numel() and (known.min() < -size or known.max() >= size):
            refuse(low, f"an index is out of range for a dim of size {size}")
        return low.constant(torch.where(known < 0, known + size, known), "indices")
    negative = low.emit1("lt", [indices, low.scalar(0, indices)])
    return low.emit1("where", [negative, low.emit1("add", [indices, low.scalar(size, indices)]),
                               indices])


@handles("Gather")
def _gather(low, node, ins, attrs):
    data, indices = ins
    axis = axis_of(low, attrs.get("axis", 0), data.type.rank)
    indices = _normalized_indices(low, indices, data.type.shape[axis])
    flat = low.emit1("reshape", [indices], {"shape": [indices.type.numel]})
    picked = low.emit1("index_select", [data, flat], {"dim": axis})
    shape = list(data.type.shape[:axis]) + list(indices.type.shape) + list(data.type.shape[axis + 1:])
    return [low.emit1("reshape", [picked], {"shape": shape})]


@handles("GatherElements")
def _gather_elements(low, node, ins, attrs):
    data, indices = ins
    axis = axis_of(low, attrs.get("axis", 0), data.type.rank)
    indices = _normalized_indices(low, indices, data.type.shape[axis])
    return [low.emit1("gather", [data, indices], {"dim": axis})]


@handles("ScatterElements")
def _scatter_elements(low, node, ins, attrs):
    data, indices, updates = ins
    if attrs.get("reduction", "none") != "none":
        refuse(low, f"reduction={attrs['reduction']!r}")
    axis = axis_of(low, attrs.get("axis", 0), data.type.rank)
    indices = _normalized_indices(low, indices, data.type.shape[axis])
    return [low.emit1("scatter", [data, indices, updates], {"dim": axis})]


@handles("GatherND")
def _gather_nd(low, node, ins, attrs):
    """data[indices[..., 0], ..., indices[..., k-1]]: the k leading dims are flattened into
    one, indexed by the linearized indices."""
    data, indices = ins
    if attrs.get("batch_dims", 0):
        refuse(low, "batch_dims > 0")
    k = indices.type.shape[-1] if indices.type.rank else 0
    if indices.type.rank == 0 or not 0 < k <= data.type.rank:
        refuse(low, f"indices of shape {list(indices.type.shape)} for data of rank {data.type.rank}")
    lead = list(data.type.shape[:k])
    linear = None
    for j in range(k):
        part = low.emit1("slice", [indices], {"dim": indices.type.rank - 1, "start": j,
                                              "end": j + 1, "step": 1})
        part = _normalized_indices(low, part, lead[j])
        stride = math.prod(lead[j + 1:])
        if stride != 1:
            part = low.emit1("mul", [part, low.scalar(stride, part)])
        linear = part if linear is None else low.emit1("add", [linear, part])
    rest = list(data.type.shape[k:])
    flat_data = low.emit1("reshape", [data], {"shape": [math.prod(lead)] + rest})
    count = math.prod(indices.type.shape[:-1])
    flat_index = low.emit1("reshape", [linear], {"shape": [count]})
    picked = low.emit1("index_select", [flat_data, flat_index], {"dim": 0})
    return [low.emit1("reshape", [picked], {"shape": list(indices.type.shape[:-1]) + rest})]
