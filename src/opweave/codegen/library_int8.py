"""The int8 forms of an anchor group (precision "int8" and "int8-dynamic"): torch's
`qlinear_pointwise` / `qconv2d_pointwise` and oneDNN's own int8 primitives
("onednn-int8-direct", codegen/onednn_direct.py), each with its quantization, bias,
activation and residual fused, wrapped in `int8.Int8Group` for calibration and codes
(codegen/int8.py, docs/precision.md). codegen/library.py offers them beside the group's
float32 forms."""
from __future__ import annotations

from functools import cache, lru_cache
from typing import Callable

import torch

from .. import shared_constants
from ..ir import Graph
from ..ir.graph import Node
from ..notices import warn_once
from ..partition.classify import constant_of
from ..partition.legality import Epilogue
from . import int8, onednn_direct, quantize
from .anchor_group import (as_2d, bias_input, conv_views, direct_fits, direct_geometry,
                           direct_offered, direct_unary, group_inputs, pointwise_conv, shaped,
                           supports, torch_unary)


def int8_forms(graph, anchor, ep, out_shape, inplace, precision, fp32) -> dict:
    """The group's int8 forms by name ("onednn-int8", and "onednn-int8-gemm" for a 1x1
    convolution as a GEMM), or none (with one warning) where they cannot be made: the
    group then has its float32 forms only, and the rest of the graph is unaffected."""
    try:
        if precision == "int8-dynamic":
            forms = {"onednn-int8": _int8_linear_dynamic(graph, anchor, ep, out_shape)}
            if int8_direct_offered(anchor, ep):
                forms.update(_int8_direct_dynamic(graph, anchor, ep, out_shape))
            return forms
        # a linear layer adding a residual writes float32; a convolution summing into one
        # writes the residual's type, uint8 where it arrives as codes
        conv = anchor.op == "conv"
        make = _int8_conv if conv else _int8_linear
        codes_in, codes_accum = codes_arriving(graph, anchor, ep)

        def group(build):
            return int8.Int8Group(build, fp32, requantizes=conv or ep.binary is None,
                                  sums=conv and ep.binary is not None, codes_in=codes_in,
                                  codes_accum=codes_accum)
        made = make(graph, anchor, ep, out_shape, inplace)
        forms = {"onednn-int8": group(made)}
        if int8_direct_offered(anchor, ep):
            forms["onednn-int8-direct"] = group(_int8_direct_or_torch(
                graph, anchor, ep, out_shape, inplace, made))
        if conv and pointwise_conv(anchor) and ep.binary is None:
            forms["onednn-int8-gemm"] = int8.Int8Group(
                _int8_conv_as_linear(graph, anchor, ep, out_shape), fp32, requantizes=True,
                codes_in=codes_in)
        return forms
    except Exception as err:  # noqa: BLE001  (this group stays float32)
        types = ", ".join(str(v.type) for v in anchor.inputs)
        warn_once(f"opweave: a {anchor.op} group ({types}) has no int8 form and computes in "
                  f"float32: {type(err).__name__}: {err}", int8.Int8Warning)
        return {}


def int8_direct_offered(anchor: Node, ep: Epilogue) -> bool:
    """Whether a static int8 group has the form "onednn-int8-direct": where the direct form
    is offered to it in float32, on a CPU where oneDNN's own library has int8 primitives
    (`onednn_direct.int8_problem`)."""
    return direct_fits(anchor, ep) and direct_offered() and onednn_direct.int8_problem() is None


def _int8_direct_conv(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a convolution group on oneDNN's own library: `build` as
    `_int8_conv`'s. Its primitive is made once per set of scales, with the requantization,
    bias, activation and residual sum fused; a residual it sums into is copied first
    unless it is dead after the group (`inplace`) or float32 (then the binary add reads
    it)."""
    one_d, _, geometry = direct_geometry(graph, anchor)
    qweight, scales = _int8_weight(graph, anchor)  # those torch's int8 form packs
    qweight = qweight.unsqueeze(2) if one_d else qweight
    bias = _conv_bias(graph, anchor)
    unary = direct_unary(ep)
    cl = torch.channels_last
    to_2d, finish = conv_views(one_d, out_shape)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        binary = onednn_direct.NO_BINARY if ep.binary is None else \
            onednn_direct.SUM_IN_PLACE if inplace or out is not None else onednn_direct.ADD
        conv = onednn_direct.DirectConv(
            geometry, qweight, bias, unary, binary,
            quant=onednn_direct.Int8Quantization(scale, zero_point, scales, out, accum))
        conv.implementation()  # made now: ReferenceOnly is raised here, not in a call

        def run(x, other=None):
            x = to_2d(to_codes(x))
            if other is None:
                return [finish(conv(x))]
            acc = to_2d(other)
            if binary == onednn_direct.SUM_IN_PLACE and not inplace:
                acc = acc.clone(memory_format=cl)
            return [finish(conv(x, acc))]
        return run
    return build


def _int8_direct_product(graph, anchor, ep) -> Callable:
    """`make(**quantization)`: a linear group's direct int8 primitive, its
    `Int8Quantization` given all but the weight's scales, made at once, so that
    ReferenceOnly is raised there. Its int8 weight, scales and bias are taken now, at
    compile time. A residual it adds is float32, and so is its result then."""
    m, k = anchor.inputs[0].type.shape
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    qweight, scales = _int8_weight(graph, anchor)
    b = bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b).reshape(n)
    unary = direct_unary(ep)
    binary = onednn_direct.NO_BINARY if ep.binary is None else onednn_direct.ADD

    def make(**quantization) -> onednn_direct.DirectLinear:
        quant = onednn_direct.Int8Quantization(weight_scales=scales, **quantization)
        product = onednn_direct.DirectLinear((m, k, n), qweight.t(), bias, unary, binary,
                                             quant=quant)
        product.implementation()
        return product
    return make


def _int8_direct_linear(graph, anchor, ep, out_shape):
    """The int8 form of a linear group on oneDNN's own library: `build` as `_int8_linear`'s."""
    m, n = anchor.inputs[0].type.shape[0], anchor.inputs[1].type.shape[1]
    make = _int8_direct_product(graph, anchor, ep)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        product = make(scale=scale, zero_point=zero_point, out=out)

        def run(x, other=None):
            residual = None if other is None else other.reshape(m, n)
            return [shaped(product(to_codes(x), residual), out_shape)]
        return run
    return build


def _int8_direct_dynamic(graph, anchor, ep, out_shape) -> dict:
    """{"onednn-int8-direct": a linear group on oneDNN's own int8 primitive, its activation
    quantized at each call's own range}, or nothing where the primitive cannot be made
    (said once: torch's dynamic int8 form remains)."""
    m, n = anchor.inputs[0].type.shape[0], anchor.inputs[1].type.shape[1]
    try:
        product = _int8_direct_product(graph, anchor, ep)(scale=1.0, zero_point=0,
                                                           dynamic=True)
    except (onednn_direct.ReferenceOnly, RuntimeError, ValueError) as err:
        _no_direct_int8(anchor, err)
        return {}
    to_codes = quantize.DynamicQuantizer()

    def linear(x, other=None):
        codes, scale, zero_point = to_codes(x)
        residual = None if other is None else other.reshape(m, n)
        return [shaped(product(codes, residual, (scale, zero_point)), out_shape)]
    return {"onednn-int8-direct": linear}


def _no_direct_int8(anchor: Node, err: Exception) -> None:
    """Says once that a group has no direct int8 form, and why."""
    types = ", ".join(str(v.type) for v in anchor.inputs)
    warn_once(f"opweave: a {anchor.op} group ({types}) has no direct int8 form "
              f"({type(err).__name__}: {err}); torch's oneDNN int8 form runs instead",
              onednn_direct.OneDNNWarning)


def _int8_direct_or_torch(graph, anchor, ep, out_shape, inplace, torch_build) -> Callable:
    """The direct int8 form's `build`, which builds torch's int8 form instead (said once)
    where the direct one cannot be made: its primitive is oneDNN's reference
    implementation (`ReferenceOnly`, 100-1000x slower), or oneDNN refuses it. The group
    keeps an int8 form either way."""
    try:
        direct = _int8_direct_conv(graph, anchor, ep, out_shape, inplace) \
            if anchor.op == "conv" else _int8_direct_linear(graph, anchor, ep, out_shape)
    except (RuntimeError, ValueError) as err:
        _no_direct_int8(anchor, err)
        return torch_build

    def build(*qparams):
        try:
            return direct(*qparams)
        except (onednn_direct.ReferenceOnly, RuntimeError, ValueError) as err:
            _no_direct_int8(anchor, err)
            return torch_build(*qparams)
    return build


@lru_cache(maxsize=1)
def supported() -> bool:
    """Whether torch has oneDNN's int8 primitives."""
    return supports() and all(hasattr(torch.ops.onednn, op) for op in
                              ("qlinear_pointwise", "qconv2d_pointwise", "qlinear_prepack",
                               "qconv_prepack"))


def codes_arriving(graph: Graph, anchor: Node, ep: Epilogue) -> tuple[bool, bool]:
    """Whether a static int8 group's input, and its residual, may arrive as uint8 codes
    (int8.arrives_as_codes): its int8 form is measured on them so."""
    operands = group_inputs(anchor, ep)
    return (int8.arrives_as_codes(graph, operands[0]),
            len(operands) > 1 and int8.arrives_as_codes(graph, operands[1]))


def fuses(anchor: Node, ep: Epilogue) -> bool:
    """Whether oneDNN's int8 primitive computes the whole group (its unary epilogue is one
    it fuses; a 2-D or 1-D convolution; a linear layer over rows)."""
    if ep.unary is not None and ep.unary.op not in int8.FUSED_UNARY[anchor.op]:
        return False
    if ep.unary is not None and ep.unary.op == "clamp" and ep.binary is not None:
        return False  # the int8 sum's op names its activation; it has no bounds to give
    rank = len(anchor.inputs[0].type.shape)
    return rank == 2 if anchor.op == "matmul" else rank in (3, 4)


def _int8_output(out) -> tuple[float, int, torch.dtype | None]:
    """oneDNN's (output scale, zero point, dtype) for an int8 product: float32, or uint8
    codes at `out` = (scale, zero point)."""
    return (1.0, 0, torch.float32) if out is None else (*out, None)


def _conv_bias(graph, anchor) -> torch.Tensor | None:
    """A convolution's constant bias in float32, as the int8 primitives read it."""
    return constant_of(graph, anchor.inputs[2]).float().contiguous() \
        if len(anchor.inputs) > 2 else None


def _int8_weight(graph, anchor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale per output channel) of a convolution ([O, C/groups, ...]) or
    linear layer ([N, K]: the [K, N] weight transposed), quantized once for every form of
    a sharing scope that reads it."""
    w = constant_of(graph, anchor.inputs[1])
    linear = anchor.op == "matmul"
    suffix = "-t" if linear else ""
    # (one quantization for both, where neither is shared yet)
    qparams = cache(lambda: quantize.weight_qparams(w.t() if linear else w))
    return (shared_constants.derived("int8-weight" + suffix, [w], (), lambda: qparams()[0]),
            shared_constants.derived("int8-scales" + suffix, [w], (), lambda: qparams()[1]))


def _int8_linear_parts(graph, anchor, ep):
    """(rows, columns, packed int8 weight, its scales, zero points, bias) of a linear group."""
    m, k = anchor.inputs[0].type.shape
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    w = constant_of(graph, anchor.inputs[1])
    qweight, scales = _int8_weight(graph, anchor)
    packed = shared_constants.derived(
        "qlinear-pack", [w], (m,), lambda: torch.ops.onednn.qlinear_prepack(qweight, [m, k]))
    bias = None
    if ep.bias is not None:
        b = next(v for v in ep.bias.inputs if v is not anchor.outputs[0])
        bias = constant_of(graph, b).reshape(n).float().contiguous()
    return m, n, packed, scales, torch.zeros(n, dtype=torch.long), bias


def _int8_linear(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a linear group: `build(scale, zero point, out, accum)`
    (int8.Int8Group; a linear layer's residual stays float32, so `accum` is None)."""
    m, n, packed, scales, zero_points, bias = _int8_linear_parts(graph, anchor, ep)
    attr, scalars, algorithm = torch_unary(ep)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)
        if ep.binary is not None:
            op = torch.ops.onednn.qlinear_pointwise.binary
            return lambda x, other: [shaped(op(
                to_codes(x), scale, zero_point, packed, scales, zero_points,
                other.reshape(m, n), bias, o_scale, o_zp, o_dtype, 1.0, 0, "add", 1.0,
                attr, scalars, algorithm), out_shape)]
        op = torch.ops.onednn.qlinear_pointwise.default
        return lambda x: [shaped(op(to_codes(x), scale, zero_point, packed, scales,
                                     zero_points, bias, o_scale, o_zp, o_dtype, attr, scalars,
                                     algorithm), out_shape)]
    return build


def _int8_conv_as_linear(graph, anchor, ep, out_shape):
    """A 1x1 convolution over a channels-last image in int8 as a GEMM [H*W, C] x [C, O]
    (`qlinear_pointwise`: about 8 µs less per call than the convolution op, and a few
    percent faster on ResNet-50's shapes): `build` as `_int8_conv`'s, without residual."""
    _, c, h, w = anchor.inputs[0].type.shape
    o = anchor.inputs[1].type.shape[0]
    weight = constant_of(graph, anchor.inputs[1])
    qweight, scales = _int8_weight(graph, anchor)
    packed = shared_constants.derived(
        "qlinear-pack-1x1", [weight], (h * w,),
        lambda: torch.ops.onednn.qlinear_prepack(qweight.reshape(o, c), [h * w, c]))
    zero_points = torch.zeros(o, dtype=torch.long)
    bias = _conv_bias(graph, anchor)
    attr, scalars, algorithm = torch_unary(ep)
    op = torch.ops.onednn.qlinear_pointwise.default

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)

        def gemm(x):
            rows = to_codes(x).permute(0, 2, 3, 1).reshape(h * w, c)  # a view if channels-last
            y = op(rows, scale, zero_point, packed, scales, zero_points, bias, o_scale, o_zp,
                   o_dtype, attr, scalars, algorithm)
            return [shaped(y.view(1, h, w, o).permute(0, 3, 1, 2), out_shape)]
        return gemm
    return build


def _int8_linear_dynamic(graph, anchor, ep, out_shape):
    """A linear group in int8 with its activation quantized at each call's own range."""
    m, n, packed, scales, zero_points, bias = _int8_linear_parts(graph, anchor, ep)
    attr, scalars, algorithm = torch_unary(ep)
    to_codes = quantize.DynamicQuantizer()
    if ep.binary is not None:
        op = torch.ops.onednn.qlinear_pointwise.binary_tensor

        def linear_add(x, other):
            codes, scale, zero_point = to_codes(x)
            return [shaped(op(codes, scale, zero_point, packed, scales, zero_points,
                               other.reshape(m, n), bias, 1.0, 0, torch.float32, 1.0, 0, "add",
                               1.0, attr, scalars, algorithm), out_shape)]
        return linear_add
    op = torch.ops.onednn.qlinear_pointwise.tensor

    def linear(x):
        codes, scale, zero_point = to_codes(x)
        return [shaped(op(codes, scale, zero_point, packed, scales, zero_points, bias, 1.0, 0,
                           torch.float32, attr, scalars, algorithm), out_shape)]
    return linear


def _int8_conv(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a convolution group (1-D ones as 2-D over a height of 1); with a
    residual add, oneDNN sums into an accumulator: the residual itself where it is dead
    after the group (`inplace`), else a copy of it; float32, or uint8 codes at `accum`
    (then the result is uint8 codes at `out`)."""
    w = constant_of(graph, anchor.inputs[1])
    bias = _conv_bias(graph, anchor)
    one_d, size, padding, stride, dilation = as_2d(anchor)
    groups = anchor.attrs["groups"]
    qweight, scales = _int8_weight(graph, anchor)
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    cl = torch.channels_last
    to_2d, finish = conv_views(one_d, out_shape)

    def build(scale, zero_point, out, accum):
        packed = torch.ops.onednn.qconv_prepack(
            qweight.unsqueeze(2) if one_d else qweight, scales, scale, zero_point, stride,
            padding, dilation, groups, size)
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)
        if ep.binary is not None:
            op = torch.ops.onednn.qconv2d_pointwise.binary
            unary = ep.unary.op if ep.unary is not None else "none"
            # the accumulator's (scale, zero point): float32 ones must be (1, 0)
            a_scale, a_zp = accum if accum is not None else (1.0, 0)
            assert (accum is None) == (out is None), "the sum keeps the residual's type"

            def conv_add(x, other):
                acc = to_2d(other)
                acc = acc.contiguous(memory_format=cl) if inplace else acc.clone(memory_format=cl)
                return [finish(op(to_2d(to_codes(x)), scale, zero_point, packed, scales,
                                  zero_points, acc, bias, stride, padding, dilation, groups,
                                  o_scale, o_zp, o_dtype, a_scale, a_zp, "sum", 1.0, unary,
                                  [], ""))]
            return conv_add
        op = torch.ops.onednn.qconv2d_pointwise.default
        attr, scalars, algorithm = torch_unary(ep)
        return lambda x: [finish(op(to_2d(to_codes(x)), scale, zero_point, packed, scales,
                                    zero_points, bias, stride, padding, dilation, groups,
                                    o_scale, o_zp, o_dtype, attr, scalars, algorithm))]
    return build
