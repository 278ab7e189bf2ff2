"""ONNX Resize and Upsample -> IR ops.

Where the ONNX modes are torch's (an [N, C, H, W] input resized along H and W: nearest
with asymmetric coordinates rounded down by a whole factor, or linear with half-pixel or
align-corners coordinates), the IR's `upsample_nearest2d` / `upsample_bilinear2d`, which
run as torch's kernels. Every other nearest, linear or cubic resize is separable and
computed exactly as the ONNX reference does: per resized axis, the source positions and
weights of each output position are computed at import (in float64), and the axis is
resized by one `index_select` per tap, weighted and summed. Antialiasing and
tf_crop_and_resize are refused.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..ir import symbols
from .importer import handles
from .ops_math import need_float, refuse

_TRANSFORMS = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric",
               "half_pixel_symmetric")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


@handles("Resize")
def _resize(low, node, ins, attrs):
    x = ins[0]
    rank = x.type.rank
    if low.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        attrs = {**attrs, "coordinate_transformation_mode": "asymmetric",
                 "nearest_mode": "floor"}
        scales_in, sizes_in = (ins[1] if len(ins) > 1 else None), None
    else:
        scales_in = ins[2] if len(ins) > 2 else None
        sizes_in = ins[3] if len(ins) > 3 else None
    if attrs.get("antialias", 0):
        refuse(low, "antialias=1")
    axes = list(attrs.get("axes", range(rank)))
    if any(not -rank <= a < rank for a in axes):
        refuse(low, f"axes {axes} for rank {rank}")
    axes = [a % rank for a in axes]
    scales = _floats(low, scales_in)
    sizes = low.ints(sizes_in, "sizes") if sizes_in is not None and \
        sizes_in.type.numel != 0 else None
    if (scales is None) == (sizes is None):
        refuse(low, "exactly one of scales and sizes must be given")
    if len(scales or sizes) != len(axes):
        refuse(low, f"{len(scales or sizes)} {'scales' if scales else 'sizes'} for axes {axes}")
    out, factors = _output_shape(low, x, axes, scales, sizes,
                                 attrs.get("keep_aspect_ratio_policy", "stretch"))
    return [_resized(low, x, out, factors, attrs, given_scales=scales is not None)]


@handles("Upsample")
def _upsample(low, node, ins, attrs):
    """Upsample (opsets 7 to 9): Resize with asymmetric coordinates, rounded down."""
    x = ins[0]
    scales = list(attrs["scales"]) if "scales" in attrs else _floats(low, ins[1])
    if scales is None or len(scales) != x.type.rank:
        refuse(low, f"scales {scales} for a rank-{x.type.rank} input")
    axes = list(range(x.type.rank))
    out, factors = _output_shape(low, x, axes, scales, None, "stretch")
    mode = attrs.get("mode", "nearest")
    resize_attrs = {"mode": "linear" if mode in ("linear", "bilinear") else mode,
                    "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    return [_resized(low, x, out, factors, resize_attrs, given_scales=True)]


def _floats(low, value) -> list[float] | None:
    if value is None or value.type.numel == 0:
        return None
    return [float(f) for f in low.require_const(value, "scales").reshape(-1).tolist()]


def _output_shape(low, x, axes, scales, sizes, policy):
    """The output shape and each axis's scale factor, as the ONNX reference computes them:
    floor(in * scale) from scales; from sizes, scale = out / in (one factor for all the
    axes under keep_aspect_ratio_policy not_larger / not_smaller)."""
    shape = list(x.type.shape)
    factors = [1.0] * len(shape)
    resized = [a for i, a in enumerate(axes)
               if (scales[i] != 1.0 if scales else sizes[i] != shape[a])]
    if symbols.free_symbols([shape[a] for a in resized]):
        if sizes is not None or not all(float(scales[axes.index(a)]).is_integer()
                                        for a in resized):
            refuse(low, "resizing a size known only per call by other than a whole factor")
    if scales is not None:
        if any(not (s > 0 and math.isfinite(s)) for s in scales):
            refuse(low, f"scales {scales} must be finite and positive")
        for a, s in zip(axes, scales):
            factors[a] = s
            size = shape[a]
            shape[a] = size * int(s) if symbols.is_symbolic(size) else int(size * s)
        return shape, factors
    if any(s < 1 for s in sizes):
        refuse(low, f"sizes {sizes} must be positive")
    ratios = [s / shape[a] for a, s in zip(axes, sizes)]
    if policy in ("not_larger", "not_smaller"):
        common = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            factors[a] = common
            shape[a] = int(common * shape[a] + 0.5)
        return shape, factors
    if policy != "stretch":
        refuse(low, f"keep_aspect_ratio_policy={policy!r}")
    for a, s, r in zip(axes, sizes, ratios):
        factors[a], shape[a] = r, s
    return shape, factors


def _resized(low, x, out, factors, attrs, given_scales: bool):
    mode = attrs.get("mode", "nearest")
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    nearest = attrs.get("nearest_mode", "round_prefer_floor")
    if mode not in ("nearest", "linear", "cubic"):
        refuse(low, f"mode={mode!r}")
    if transform not in _TRANSFORMS:
        refuse(low, f"coordinate_transformation_mode={transform!r}")
    if mode == "nearest" and nearest not in _NEAREST_MODES:
        refuse(low, f"nearest_mode={nearest!r}")
    if mode != "nearest":
        need_float(low, x)
    axes = [a for a, (n, o) in enumerate(zip(x.type.shape, out))
            if n != o or factors[a] != 1.0]
    if not axes:
        return x
    op = _torch_form(x, axes, out, factors, mode, transform, nearest, attrs)
    if op is not None:
        scaled = given_scales and not (op == "upsample_bilinear2d" and transform == "align_corners")
        extra = {"align_corners": transform == "align_corners"} if op == "upsample_bilinear2d" \
            else {}
        return low.emit1(op, [x], {"size": out[2:], **extra,
                                   "scales_h": factors[2] if scaled else None,
                                   "scales_w": factors[3] if scaled else None})
    if symbols.free_symbols(list(x.type.shape[a] for a in axes)):
        refuse(low, "this resize over a size known only per call")
    y = x
    for axis in axes:
        index, weights = _taps(x.type.shape[axis], out[axis], factors[axis], mode, transform,
                               nearest, attrs)
        y = _resize_axis(low, y, axis, index, weights)
    return y


def _torch_form(x, axes, out, factors, mode, transform, nearest, attrs) -> str | None:
    """The IR upsampling op that computes this resize exactly as ONNX does, or None."""
    if x.type.rank != 4 or axes != [2, 3] or x.type.dtype not in (torch.float32, torch.float64):
        return None
    if mode == "nearest":
        # torch multiplies by 1 / factor in float32: exact for whole factors
        whole = all(float(factors[a]).is_integer() and out[a] == x.type.shape[a] * int(factors[a])
                    for a in axes)
        return "upsample_nearest2d" if whole and transform == "asymmetric" and \
            nearest == "floor" else None
    if mode != "linear" or attrs.get("exclude_outside", 0):
        return None
    if transform == "half_pixel" or \
            (transform == "pytorch_half_pixel" and all(o > 1 for o in out[2:])):
        return "upsample_bilinear2d"
    # ONNX aligns the corners of the unrounded output length (in * scale), torch those of
    # the output: the same where the scale gives a whole length
    if transform == "align_corners" and all(out[a] == x.type.shape[a] * factors[a] for a in axes):
        return "upsample_bilinear2d"
    return None


def _source_positions(n_in: int, n_out: int, scale: float, transform: str) -> np.ndarray:
    """Where each output position falls in the input (ONNX's coordinate transforms)."""
    y = np.arange(n_out, dtype=np.float64)
    length = scale * n_in  # the output length before flooring
    if transform == "align_corners":
        return np.zeros(n_out) if length == 1 else y * (n_in - 1) / (length - 1)
    if transform == "asymmetric":
        return y / scale
    if transform == "pytorch_half_pixel":
        return np.full(n_out, -0.5) if length == 1 else (y + 0.5) / scale - 0.5
    if transform == "half_pixel":
        return (y + 0.5) / scale - 0.5
    offset = n_in / 2 * (1 - n_out / length)  # half_pixel_symmetric
    return offset + (y + 0.5) / scale - 0.5


def _taps(n_in, n_out, scale, mode, transform, nearest, attrs):
    """[n_out, taps] input indices (edge positions repeated past the ends) and weights."""
    x = _source_positions(n_in, n_out, scale, transform)
    floor = np.floor(x)
    ratio = np.where(x == floor, 1.0, x - floor)  # an exact position takes the left tap
    if mode == "nearest":
        rounds_up = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
                     "floor": np.zeros_like(ratio, bool), "ceil": np.ones_like(ratio, bool)}
        up = np.where(ratio == 1.0, True, rounds_up[nearest])
        weights = np.stack([~up, up], axis=1).astype(np.float64)
    elif mode == "linear":
        weights = np.stack([1 - ratio, ratio], axis=1)
    else:
        weights = _cubic_weights(ratio, float(attrs.get("cubic_coeff_a", -0.75)))
    taps = weights.shape[1]
    pad = math.ceil(taps / 2)
    padded = x + pad
    start = np.floor(padded)
    frac = padded - start
    start = start + np.where(frac == 0, -(taps // 2), -(taps // 2) + 1)
    index = start[:, None].astype(np.int64) + np.arange(taps)[None, :] - pad
    if attrs.get("exclude_outside", 0):
        weights = np.where((index < 0) | (index >= n_in), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(index, 0, n_in - 1), weights


def _cubic_weights(r: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution weights of the four taps around a position `r` past the
    second (ONNX's formula, with its coefficient `a`)."""
    s = 1 - r
    return np.stack([((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                     ((a + 2) * r - (a + 3)) * r * r + 1,
                     ((a + 2) * s - (a + 3)) * s * s + 1,
                     ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a], axis=1)


def _resize_axis(low, x, axis: int, index: np.ndarray, weights: np.ndarray):
    """`x` resized along `axis`: the sum over taps of the picked positions times their
    weights; a tap whose weights are 0 or 1 everywhere (nearest) is a pick alone."""
    one_hot = np.all((weights == 0) | (weights == 1), axis=1) & (weights.sum(axis=1) == 1)
    if one_hot.all():
        picked = index[np.arange(len(index)), weights.argmax(axis=1)]
        return low.emit1("index_select", [x, low.constant(torch.from_numpy(picked),
                                                         "resize_index")], {"dim": axis})
    rank, total = x.type.rank, None
    for t in range(index.shape[1]):
        if not weights[:, t].any():
            continue
        picked = low.emit1("index_select", [x, low.constant(torch.from_numpy(index[:, t].copy()),
                                                            "resize_index")], {"dim": axis})
        shape = [1] * rank
        shape[axis] = len(index)
        weight = torch.from_numpy(weights[:, t].reshape(shape)).to(x.type.dtype)
        term = low.emit1("mul", [picked, low.constant(weight, "resize_weight")])
        total = term if total is None else low.emit1("add", [total, term])
    return total
