"""Contractions and windows: matmul, sparse mm, convolution (plain and transposed) and
their backwards, average pooling, upsampling, padding, attention."""
from __future__ import annotations

import torch

from ...ir import padding, symbols
from ..lowering import Unsupported, lowers
from .common import _pair, _shape, aten, reads_output
from .layout import _expand, reshape

# -- contractions ------------------------------------------------------------------------------
@lowers(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(ctx, a, b):
    sparse = ctx.constant_tensor(a)
    if sparse is not None and sparse.layout == torch.sparse_coo:
        return _sparse_mm(ctx, sparse, ctx.value(b))
    return ctx.add1("matmul", [ctx.value(a), ctx.value(b)])


@lowers(aten.addmm.default)
def _addmm(ctx, bias, a, b, beta=1, alpha=1):
    out = ctx.add1("matmul", [ctx.value(a), ctx.value(b)])
    if alpha != 1:
        out = ctx.add1("mul", [out, ctx.scalar(alpha, out)])
    if beta == 0:
        return out
    vbias = ctx.value(bias)
    if beta != 1:
        vbias = ctx.add1("mul", [vbias, ctx.scalar(beta, vbias)])
    return ctx.add1("add", [out, vbias])


def _sparse_mm(ctx, sparse: torch.Tensor, dense):
    sparse = sparse.coalesce()
    rows, cols = sparse.shape
    indices = ctx.graph.add_constant("sparse_indices", sparse.indices())
    values = ctx.graph.add_constant("sparse_values", sparse.values())
    return ctx.add1("sparse_mm", [indices, values, dense], {"rows": rows, "cols": cols})


@lowers(aten._sparse_addmm.default)
def _sparse_addmm(ctx, bias, sparse, dense, beta=1, alpha=1):
    data = ctx.constant_tensor(sparse)
    if data is None or data.layout != torch.sparse_coo:
        raise Unsupported("sparse matmul needs the sparse operand to be a constant COO tensor")
    out = _sparse_mm(ctx, data, ctx.value(dense))
    if alpha != 1:
        out = ctx.add1("mul", [out, ctx.scalar(alpha, out)])
    if beta == 0:
        return out
    return ctx.add1("add", [out, ctx.add1("mul", [ctx.value(bias), ctx.scalar(beta, out)])])


@lowers(aten.convolution.default)
def _convolution(ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    inputs = [ctx.value(x), ctx.value(weight)] + ([ctx.value(bias)] if bias is not None else [])
    spatial = inputs[0].type.rank - 2

    def per_dim(v):  # torch broadcasts one value to every spatial dim (padding="valid": [0])
        return list(v) * spatial if len(v) == 1 else list(v)

    attrs = {"stride": per_dim(stride), "padding": per_dim(padding),
             "dilation": per_dim(dilation), "groups": groups}
    if transposed:
        return ctx.add1("conv_transpose", inputs,
                        {**attrs, "output_padding": per_dim(output_padding)})
    return ctx.add1("conv", inputs, attrs)


@lowers(aten.hardtanh.default)
def _hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    """ReLU6 (MobileNetV2) is hardtanh(0, 6)."""
    return ctx.add1("clamp", [ctx.value(x)], {"min": min_val, "max": max_val})


@lowers(aten.avg_pool2d.default)
def _avg_pool2d(ctx, x, kernel, stride=None, padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None):
    """Average pooling: over windows that tile the input (kernel = stride, no padding), a
    mean over the split axes (fusible); over overlapping or padded windows, the
    `avg_pool2d` op. A divisor override runs in eager."""
    v = ctx.value(x)
    kernel, stride = _pair(kernel), _pair(stride, _pair(kernel))
    padding = _pair(padding if isinstance(padding, (list, tuple)) else [padding])
    shape = _shape(v)
    if not any(padding) and divisor_override is None and \
            all(k >= size for k, size in zip(kernel, shape[-2:])):
        # one window over the whole input (EfficientNet's pooler: kernel = channels, ceil
        # mode); torch divides by the cells inside the input, so this is the mean
        return ctx.add1("mean", [v], {"dims": [len(shape) - 2, len(shape) - 1],
                                      "keepdim": True})
    if divisor_override is not None:
        raise Unsupported("average pooling with a divisor override")
    if stride == kernel and not any(padding) and not ceil_mode and \
            not any(size % k for size, k in zip(shape[-2:], kernel)):
        return _tile_mean(ctx, v, kernel)
    return ctx.add1("avg_pool2d", [v], {"kernel": kernel, "stride": stride, "padding": padding,
                                        "ceil_mode": bool(ceil_mode),
                                        "count_include_pad": bool(count_include_pad)})


@lowers(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(ctx, grad, x, kernel, stride, padding, ceil_mode, count_include_pad,
                         divisor_override):
    if divisor_override is not None:
        raise Unsupported("average pooling with a divisor override")
    kernel = _pair(kernel)
    return ctx.add1("avg_pool2d_backward", [ctx.value(grad), ctx.value(x)],
                    {"kernel": kernel, "stride": _pair(stride, kernel),
                     "padding": _pair(padding if isinstance(padding, (list, tuple)) else [padding]),
                     "ceil_mode": bool(ceil_mode), "count_include_pad": bool(count_include_pad)})


@lowers(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d(ctx, x, output_size):
    """Adaptive average pooling where each output cell averages a tile of the input
    (the input size a multiple of the output size), or repeats a 1x1 input."""
    v = ctx.value(x)
    shape, out = _shape(v), _pair(output_size)
    if shape[-2:] == [1, 1]:
        return _expand(ctx, x, shape[:-2] + out)
    if any(size % o for size, o in zip(shape[-2:], out)):
        raise Unsupported("adaptive average pooling with overlapping windows")
    return _tile_mean(ctx, v, [size // o for size, o in zip(shape[-2:], out)])


def _tile_mean(ctx, v, kernel):
    """Mean over non-overlapping kh x kw tiles of the last two axes."""
    *lead, h, w = _shape(v)
    (kh, kw) = kernel
    if (kh, kw) == (1, 1):
        return v
    split = reshape(ctx, v, lead + [h // kh, kh, w // kw, kw])
    rank = len(lead) + 4
    mean = ctx.add1("mean", [split], {"dims": [rank - 3, rank - 1], "keepdim": False})
    return mean


# -- upsampling ---------------------------------------------------------------------------------
def _upsample_size(v, output_size, scale_factors) -> tuple[list, list]:
    """The output [H, W] and the factors torch's kernel is given (None where the size was
    given), as `upsample_*2d.vec` computes them: floor(in * factor)."""
    if output_size is not None:
        return list(output_size), [None, None]
    factors = [float(f) for f in _pair(scale_factors)]
    size = []
    for dim, factor in zip(_shape(v)[-2:], factors):
        if symbols.is_symbolic(dim) and not factor.is_integer():
            raise Unsupported(f"upsampling a size known only per call ({dim}) by {factor}")
        size.append(dim * int(factor) if symbols.is_symbolic(dim) else int(dim * factor))
    return size, factors


def _upsample(ctx, op, x, output_size, scale_factors, **attrs):
    v = ctx.value(x)
    if v.type.rank != 4:
        raise Unsupported(f"{op} of a rank-{v.type.rank} tensor (2-d upsampling only)")
    size, (sh, sw) = _upsample_size(v, output_size, scale_factors)
    return ctx.add1(op, [v], {"size": size, "scales_h": sh, "scales_w": sw, **attrs})


@lowers(aten.upsample_nearest2d.vec)
def _upsample_nearest2d_vec(ctx, x, output_size, scale_factors):
    return _upsample(ctx, "upsample_nearest2d", x, output_size, scale_factors)


@lowers(aten.upsample_nearest2d.default)
def _upsample_nearest2d(ctx, x, output_size, scales_h=None, scales_w=None):
    return ctx.add1("upsample_nearest2d", [ctx.value(x)],
                    {"size": list(output_size), "scales_h": scales_h, "scales_w": scales_w})


@lowers(aten.upsample_bilinear2d.vec)
def _upsample_bilinear2d_vec(ctx, x, output_size, align_corners, scale_factors):
    return _upsample(ctx, "upsample_bilinear2d", x, output_size, scale_factors,
                     align_corners=bool(align_corners))


@lowers(aten.upsample_bilinear2d.default)
def _upsample_bilinear2d(ctx, x, output_size, align_corners, scales_h=None, scales_w=None):
    return ctx.add1("upsample_bilinear2d", [ctx.value(x)],
                    {"size": list(output_size), "align_corners": bool(align_corners),
                     "scales_h": scales_h, "scales_w": scales_w})


@lowers(aten.upsample_nearest2d_backward.default)
def _upsample_nearest2d_backward(ctx, grad, output_size, input_size, scales_h=None,
                                 scales_w=None):
    return ctx.add1("upsample_nearest2d_backward", [ctx.value(grad)],
                    {"size": list(output_size), "input_size": list(input_size),
                     "scales_h": scales_h, "scales_w": scales_w})


@lowers(aten.upsample_bilinear2d_backward.default)
def _upsample_bilinear2d_backward(ctx, grad, output_size, input_size, align_corners,
                                  scales_h=None, scales_w=None):
    return ctx.add1("upsample_bilinear2d_backward", [ctx.value(grad)],
                    {"size": list(output_size), "input_size": list(input_size),
                     "align_corners": bool(align_corners), "scales_h": scales_h,
                     "scales_w": scales_w})


@lowers(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    """Padding (pairs of before/after counts from the last dim backwards) as the IR spells
    it (`ir.padding`): a cat with constant blocks; negative counts crop."""
    v = ctx.value(x)
    counts = {v.type.rank - 1 - i: (pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)}
    return padding.pad(ctx.add1, v, counts, "constant", value)


@lowers(aten.convolution_backward.default)
def _convolution_backward(ctx, grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    mask = [int(bool(m)) for m in output_mask]
    attrs = {"stride": list(stride), "padding": list(padding), "dilation": list(dilation),
             "groups": groups, "output_mask": mask}
    if transposed:
        op, attrs = "conv_transpose_backward", {**attrs, "output_padding": list(output_padding)}
    else:
        op = "conv_backward"
    outs = iter(ctx.add(op, [ctx.value(grad), ctx.value(x), ctx.value(weight)], attrs))
    return [next(outs) if m else None for m in mask]


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention(ctx, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                     scale=None):
    """The IR's fused `attention`: torch's CPU kernel never holds the [seq, seq] scores,
    and measured faster than the math form at every size tried (BERT's 128 tokens: 1.6 vs
    3.4 ms; Whisper's 1500 frames: 53 vs 204 ms per layer, one thread). When the logsumexp
    is read too (a training graph's backward reads it), `attention_lse`, the same kernel
    with both outputs. (It was the math form: the rewrite's common-subexpression
    elimination then merged the backward's recomputed scores with the forward's, and
    BERT-base's joint step kept every layer's [heads, seq, seq] scores from the forward to
    the backward: 156 of its 476 MiB at batch 1, sequence 512.)"""
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    if dropout_p != 0.0:
        raise Unsupported("attention dropout")
    scale = scale if scale is not None else q.type.shape[-1] ** -0.5
    inputs = [q, k, v] + ([ctx.value(attn_mask)] if attn_mask is not None else [])
    attrs = {"scale": float(scale), "causal": bool(is_causal)}
    if not reads_output(ctx.node, 1):
        return [ctx.add1("attention", inputs, attrs), None]
    return ctx.add("attention_lse", inputs, attrs)


def _cuda_attention(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, outputs):
    """CUDA's SDPA kernels (flash, memory-efficient, cuDNN) as the IR's `attention` when
    only their output is read (inference); the logsumexp a training graph reads is laid
    out otherwise by each, and is not lowered: the node runs in eager."""
    if any(reads_output(ctx.node, i) for i in range(1, outputs)):
        raise Unsupported("CUDA attention whose logsumexp is read (training)")
    if dropout_p != 0.0:
        raise Unsupported("attention dropout")
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    scale = scale if scale is not None else q.type.shape[-1] ** -0.5
    inputs = [q, k, v] + ([ctx.value(attn_mask)] if attn_mask is not None else [])
    out = ctx.add1("attention", inputs, {"scale": float(scale), "causal": bool(is_causal)})
    return [out] + [None] * (outputs - 1)


@lowers(aten._scaled_dot_product_efficient_attention.default)
def _efficient_attention(ctx, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                         is_causal=False, *, scale=None):
    return _cuda_attention(ctx, query, key, value, attn_bias, dropout_p, is_causal, scale, 4)


@lowers(aten._scaled_dot_product_flash_attention.default)
def _cuda_flash_attention(ctx, query, key, value, dropout_p=0.0, is_causal=False,
                          return_debug_mask=False, *, scale=None):
    return _cuda_attention(ctx, query, key, value, None, dropout_p, is_causal, scale, 9)


@lowers(aten._scaled_dot_product_cudnn_attention.default)
def _cudnn_attention(ctx, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                     is_causal=False, return_debug_mask=False, *, scale=None):
    return _cuda_attention(ctx, query, key, value, attn_bias, dropout_p, is_causal, scale, 9)


@lowers(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_attention_backward(ctx, grad_out, query, key, value, out, logsumexp, dropout_p,
                              is_causal, *, attn_mask=None, scale=None):
    """The IR's fused `attention_backward` (torch's CPU kernel, as eager runs it): the
    math form held a layer's [heads, seq, seq] scores, probabilities and their gradient
    at once, what set the peak of a training step under a memory budget."""
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    if dropout_p != 0.0:
        raise Unsupported("attention dropout")
    if q.type.rank != 4 or q.type.shape[1] != k.type.shape[1]:
        raise Unsupported("attention other than [batch, heads, seq, dim] with equal head counts")
    scale = scale if scale is not None else q.type.shape[-1] ** -0.5
    inputs = [ctx.value(grad_out), q, k, v, ctx.value(out), ctx.value(logsumexp)]
    if attn_mask is not None:
        inputs.append(ctx.value(attn_mask))
    return ctx.add("attention_backward", inputs, {"scale": float(scale), "causal": bool(is_causal)})
