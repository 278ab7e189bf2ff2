"""Upsampling of the last two axes of [N, C, H, W] (decoders, U-Nets, feature pyramids,
segmentation heads) and its backward, as torch computes it: nearest (each output cell
copies the input cell at floor(dst * scale)) and bilinear (`align_corners` as torch's).

`size` is the output's [H, W]; `scales_h` / `scales_w` are the factors the user gave
(torch maps output to input coordinates by their inverse when given, by in / out when
not: the two differ where the factor does not divide exactly, so both are kept).
"""
from __future__ import annotations

import math

import torch

from .. import symbols
from ._common import Attr, MappingType, ShapeError, define, with_dense_strides

MANY = MappingType.MANY_TO_MANY
aten = torch.ops.aten

_SIZE_ATTRS = {"size": Attr("ints"), "scales_h": Attr("optional_float", None),
               "scales_w": Attr("optional_float", None)}
_BILINEAR_ATTRS = {**_SIZE_ATTRS, "align_corners": Attr("bool", False)}


def _check(name, x, spatial, attrs):
    """`x` (the input, or the backward's gradient) and the sizes: `spatial` is the
    input's [H, W]."""
    size = attrs["size"]
    if x.rank != 4:
        raise ShapeError(f"{name} needs an [N, C, H, W] input, got {x}")
    if len(size) != 2 or any(isinstance(s, int) and s < 1 for s in size):
        raise ShapeError(f"{name}: output size {list(size)} must be two sizes >= 1")
    for key, before, after in zip(("scales_h", "scales_w"), spatial, size):
        factor = attrs[key]
        if factor is None:
            continue
        if not (math.isfinite(factor) and factor > 0):
            raise ShapeError(f"{name}: {key}={factor} is not a finite positive factor")
        # torch sizes the output from a factor as floor(in * factor); other sizes would
        # send its kernel reading past the input
        if symbols.is_static([before, after]) and after != int(before * factor):
            raise ShapeError(f"{name}: {key}={factor} gives {int(before * factor)} rows "
                             f"from {before}, not {after}")
    if not x.dtype.is_floating_point:
        raise ShapeError(f"{name} needs floats, got {x}")


def _forward_shape(name):
    def shape(ins, attrs):
        _check(name, ins[0], ins[0].shape[2:], attrs)
        return [tuple(ins[0].shape[:2]) + tuple(attrs["size"])]
    return shape


def _backward_shape(name):
    def shape(ins, attrs):
        grad, size, input_size = ins[0], attrs["size"], attrs["input_size"]
        if len(input_size) != 4:
            raise ShapeError(f"{name}: input_size {list(input_size)} must be [N, C, H, W]")
        _check(name, grad, input_size[2:], attrs)
        forward = (*input_size[:2], *size)
        if any(symbols.is_static([g, f]) and g != f for g, f in zip(grad.shape, forward)):
            raise ShapeError(f"{name}: grad {grad} is not the forward's output shape "
                             f"{[*input_size[:2], *size]}")
        return [tuple(input_size)]
    return shape


def _same_dtype(ins, attrs):
    return [ins[0].dtype]


def _upsample_nearest2d(x, *, size, scales_h, scales_w):
    """Nearest upsampling: output cell (i, j) copies input cell
    (floor(i * sh), floor(j * sw)), sh = 1 / scales_h if given, else H_in / H_out."""
    return aten.upsample_nearest2d(with_dense_strides(x), size, scales_h, scales_w)


def _upsample_nearest2d_backward(grad, *, size, input_size, scales_h, scales_w):
    """Gradient of nearest upsampling: each input cell sums the cells that copied it."""
    return aten.upsample_nearest2d_backward(with_dense_strides(grad), size, input_size,
                                            scales_h, scales_w)


def _upsample_bilinear2d(x, *, size, align_corners, scales_h, scales_w):
    """Bilinear upsampling (or downsampling, without antialiasing) as torch's."""
    return aten.upsample_bilinear2d(with_dense_strides(x), size, align_corners, scales_h, scales_w)


def _upsample_bilinear2d_backward(grad, *, size, input_size, align_corners, scales_h, scales_w):
    """Gradient of bilinear upsampling: each output cell's gradient spread over its four
    input cells by the same weights."""
    return aten.upsample_bilinear2d_backward(with_dense_strides(grad), size, input_size, align_corners,
                                             scales_h, scales_w)


define("upsample_nearest2d", 1, MANY, _forward_shape("upsample_nearest2d"), _same_dtype,
       _upsample_nearest2d, attrs=_SIZE_ATTRS)
define("upsample_nearest2d_backward", 1, MANY, _backward_shape("upsample_nearest2d_backward"),
       _same_dtype, _upsample_nearest2d_backward,
       attrs={**_SIZE_ATTRS, "input_size": Attr("ints")},
       flops=lambda ins, outs, a: ins[0].numel)
# four products and three sums per output cell (two lerps along W, one along H)
define("upsample_bilinear2d", 1, MANY, _forward_shape("upsample_bilinear2d"), _same_dtype,
       _upsample_bilinear2d, attrs=_BILINEAR_ATTRS, flops=lambda ins, outs, a: 7 * outs[0].numel)
define("upsample_bilinear2d_backward", 1, MANY,
       _backward_shape("upsample_bilinear2d_backward"), _same_dtype,
       _upsample_bilinear2d_backward, attrs={**_BILINEAR_ATTRS, "input_size": Attr("ints")},
       flops=lambda ins, outs, a: 8 * ins[0].numel)
