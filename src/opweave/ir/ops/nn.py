"""Pooling (max and average), dropout and the backward ops of pooling (many-to-many)."""
from __future__ import annotations

import math

import torch

from ._common import Attr, MappingType, ShapeError, define

MANY = MappingType.MANY_TO_MANY


def _pool_out(size, kernel, stride, pad, dilation, ceil_mode):
    span = size + 2 * pad - dilation * (kernel - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _max_pool2d_shape(ins, attrs):
    x = ins[0]
    if x.rank not in (3, 4):
        raise ShapeError(f"max_pool2d needs a rank 3 or 4 input, got {x}")
    dims = [_pool_out(x.shape[-2 + i], attrs["kernel"][i], attrs["stride"][i], attrs["padding"][i],
                      attrs["dilation"][i], attrs["ceil_mode"]) for i in range(2)]
    shape = tuple(x.shape[:-2]) + tuple(dims)
    return [shape, shape] if attrs["with_indices"] else [shape]


def _with_indices_dtype(ins, attrs):
    return [ins[0].dtype, torch.int64] if attrs["with_indices"] else [ins[0].dtype]


def _max_pool2d(x, *, kernel, stride, padding, dilation, ceil_mode, with_indices):
    """2-D max pooling; with `with_indices`, also the flat argmax per window (for the backward)."""
    if with_indices:
        return torch.ops.aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
    return torch.nn.functional.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode)


_POOL_ATTRS = {"kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", [0, 0]),
               "dilation": Attr("ints", [1, 1]), "ceil_mode": Attr("bool", False)}
define("max_pool2d", 1, MANY, _max_pool2d_shape, _with_indices_dtype, _max_pool2d,
       attrs={**_POOL_ATTRS, "with_indices": Attr("bool", False)},
       flops=lambda ins, outs, a: outs[0].numel * math.prod(a["kernel"]))


def _max_pool2d_backward(grad, x, indices, *, kernel, stride, padding, dilation, ceil_mode):
    """Gradient of max_pool2d: scatter `grad` to the argmax positions."""
    return torch.ops.aten.max_pool2d_with_indices_backward(
        grad, x, kernel, stride, padding, dilation, ceil_mode, indices)


define("max_pool2d_backward", 3, MANY, lambda ins, a: [ins[1].shape], lambda ins, a: [ins[0].dtype],
       _max_pool2d_backward, attrs=_POOL_ATTRS, flops=lambda ins, outs, a: ins[0].numel)


def _avg_pool2d_shape(ins, attrs):
    x = ins[0]
    if x.rank not in (3, 4):
        raise ShapeError(f"avg_pool2d needs a rank 3 or 4 input, got {x}")
    if any(2 * p > k for p, k in zip(attrs["padding"], attrs["kernel"])):
        raise ShapeError(f"avg_pool2d's padding {attrs['padding']} is more than half its "
                         f"kernel {attrs['kernel']}")
    dims = [_pool_out(x.shape[-2 + i], attrs["kernel"][i], attrs["stride"][i],
                      attrs["padding"][i], 1, attrs["ceil_mode"]) for i in range(2)]
    if min(dims) < 1:
        raise ShapeError(f"avg_pool2d's windows do not fit {x}")
    return [tuple(x.shape[:-2]) + tuple(dims)]


def _avg_pool2d(x, *, kernel, stride, padding, ceil_mode, count_include_pad):
    """2-D average pooling, windows as torch's (Inception's 3x3 stride-1 padded pools)."""
    return torch.nn.functional.avg_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode,
                                          count_include_pad=count_include_pad)


_AVG_POOL_ATTRS = {"kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", [0, 0]),
                   "ceil_mode": Attr("bool", False), "count_include_pad": Attr("bool", True)}


def _float_only(ins, attrs):
    if not ins[0].dtype.is_floating_point:
        raise ShapeError(f"avg_pool2d needs floats, got {ins[0]}")
    return [ins[0].dtype]


define("avg_pool2d", 1, MANY, _avg_pool2d_shape, _float_only, _avg_pool2d,
       attrs=_AVG_POOL_ATTRS, flops=lambda ins, outs, a: outs[0].numel * math.prod(a["kernel"]))


def _avg_pool2d_backward(grad, x, *, kernel, stride, padding, ceil_mode, count_include_pad):
    """Gradient of avg_pool2d: each window's gradient spread evenly over its cells."""
    return torch.ops.aten.avg_pool2d_backward(grad, x, kernel, stride, padding, ceil_mode,
                                              count_include_pad, None)


define("avg_pool2d_backward", 2, MANY, lambda ins, a: [ins[1].shape], lambda ins, a: [ins[0].dtype],
       _avg_pool2d_backward, attrs=_AVG_POOL_ATTRS, flops=lambda ins, outs, a: ins[0].numel)


def _adaptive_shape(ins, attrs):
    x, size = ins[0], attrs["output_size"]
    if x.rank not in (3, 4) or len(size) != 2:
        raise ShapeError(f"adaptive_max_pool2d: input {x}, output_size {size}")
    shape = tuple(x.shape[:-2]) + tuple(size)
    return [shape, shape] if attrs["with_indices"] else [shape]


def _adaptive_max_pool2d(x, *, output_size, with_indices):
    """Adaptive (dynamic) max pooling to `output_size` windows; XML-CNN's pooling."""
    values, indices = torch.ops.aten.adaptive_max_pool2d(x, output_size)
    return (values, indices) if with_indices else values


define("adaptive_max_pool2d", 1, MANY, _adaptive_shape, _with_indices_dtype, _adaptive_max_pool2d,
       attrs={"output_size": Attr("ints"), "with_indices": Attr("bool", False)},
       flops=lambda ins, outs, a: ins[0].numel)


def _adaptive_backward(grad, x, indices):
    """Gradient of adaptive_max_pool2d."""
    return torch.ops.aten.adaptive_max_pool2d_backward(grad, x, indices)


define("adaptive_max_pool2d_backward", 3, MANY, lambda ins, a: [ins[1].shape],
       lambda ins, a: [ins[0].dtype], _adaptive_backward, flops=lambda ins, outs, a: ins[0].numel)


def _dropout(x, *, p):
    """Dropout in training mode: the output and the keep-mask. Draws from torch's RNG."""
    out, mask = torch.ops.aten.native_dropout(x, p, True)
    return out, mask.bool()  # aten returns a float mask for empty inputs


def _dropout_dtype(ins, attrs):
    if not ins[0].dtype.is_floating_point:
        raise ShapeError(f"dropout needs floats, got {ins[0]}")
    return [ins[0].dtype, torch.bool]


define("dropout", 1, MappingType.ONE_TO_ONE, lambda ins, a: [ins[0].shape, ins[0].shape],
       _dropout_dtype, _dropout, attrs={"p": Attr("float")},
       flops=lambda ins, outs, a: 2 * ins[0].numel, is_random=True)


def chunk_positions(length: int, chunks: int, device=None) -> torch.Tensor:
    """[chunks, widest] positions of each adaptive-pooling window over `length` items.

    Window i is [floor(i*L/C), ceil((i+1)*L/C)), as in adaptive pooling; shorter windows
    repeat their last position, which leaves their maximum unchanged.
    """
    starts = [i * length // chunks for i in range(chunks)]
    ends = [-(-(i + 1) * length // chunks) for i in range(chunks)]
    widest = max(e - s for s, e in zip(starts, ends))
    rows = [[min(s + j, e - 1) for j in range(widest)] for s, e in zip(starts, ends)]
    return torch.tensor(rows, dtype=torch.long, device=device)
