"""Contractions (many-to-many): matmul, convolution, transposed convolution and their
backwards, sparse-dense matmul."""
from __future__ import annotations

import math

import numpy
import torch
import torch.nn.attention

from ._common import Attr, MappingType, ShapeError, broadcast, define

MANY = MappingType.MANY_TO_MANY


def _same_float_dtype(ins, attrs):
    dtypes = {t.dtype for t in ins}
    if len(dtypes) != 1:
        raise ShapeError(f"operands must share a dtype, got {', '.join(map(str, ins))}")
    return [ins[0].dtype]


def _matmul_shape(ins, attrs):
    a, b = ins
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"matmul needs rank >= 2 operands, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: inner dims differ: {a} @ {b}")
    batch = broadcast(a.shape[:-2], b.shape[:-2])
    return [batch + (a.shape[-2], b.shape[-1])]


def _matmul_flops(ins, outs, attrs):
    return 2 * outs[0].numel * ins[0].shape[-1]


define("matmul", 2, MANY, _matmul_shape, _same_float_dtype, torch.matmul, flops=_matmul_flops,
       impl_out=lambda ins, a, out: torch.matmul(*ins, out=out))


def _attention_shape(ins, attrs):
    if len(ins) not in (3, 4):
        raise ShapeError(f"attention takes query, key, value and an optional mask; got {len(ins)}")
    q, k, v = ins[:3]
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ShapeError(f"attention: query {q}, key {k}, value {v} must be [batch, heads, seq, dim]")
    if k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3] \
            or v.shape[3] != q.shape[3]:  # (torch's fused kernel needs one head size)
        raise ShapeError(f"attention: query {q}, key {k} and value {v} do not match")
    scores = q.shape[:3] + (k.shape[2],)
    if len(ins) == 4 and (ins[3].rank > 4 or broadcast(ins[3].shape, scores) != scores):
        raise ShapeError(f"attention: mask {ins[3]} does not broadcast to the scores {list(scores)}")
    return [q.shape[:3] + (v.shape[3],)]


def _attention_dtype(ins, attrs):
    dtype = _same_float_dtype(ins[:3], attrs)
    if not dtype[0].is_floating_point:
        raise ShapeError(f"attention needs floating-point operands, got {ins[0]}")
    if len(ins) == 4 and ins[3].dtype not in (torch.bool, dtype[0]):
        raise ShapeError(f"attention: a mask is bool (keep) or additive {dtype[0]}, got {ins[3]}")
    return dtype


_GPU_ATTENTION = [torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                  torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                  torch.nn.attention.SDPBackend.MATH]


def _attention(q, k, v, mask=None, *, scale, causal):
    """softmax(scale * q k^T + mask) v, with a causal and a bool (keep) or additive mask:
    torch's fused CPU attention kernel, which never holds the [seq, seq] scores (at
    Whisper's 1500 frames the math form took 4x as long). On a GPU, torch's SDPA picks
    its flash or memory-efficient kernel (not cuDNN's, whose call copies from the host and
    so cannot be captured in a CUDA graph)."""
    if q.is_cuda and 0 not in q.shape[1:3] and k.shape[2] != 0:
        with torch.nn.attention.sdpa_kernel(_GPU_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return _fused_attention(q, k, v, mask, scale=scale, causal=causal)[0]


def _attention_lse(q, k, v, mask=None, *, scale, causal):
    """The attention and the logsumexp of each row of its masked, scaled scores (what a
    training step's backward recomputes the probabilities from), both from the fused
    kernel."""
    out, lse = _fused_attention(q, k, v, mask, scale=scale, causal=causal)
    return out, lse.contiguous()  # the kernel lays it out [batch, seq, heads]


def _fused_attention(q, k, v, mask=None, *, scale, causal):
    """(the attention, the logsumexp as the fused kernel lays it out) for `_attention_lse`;
    inference takes only the first, without copying the second (a copy per attention and
    call in every native plan: BERT-base's 12 took 13-18 us each)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if 0 in q.shape[1:3] or k.shape[2] == 0 or q.is_cuda:
        # the fused kernel divides by the heads and both lengths: it dies of SIGFPE on 0;
        # on a GPU, CUDA's kernels lay the logsumexp out otherwise (not lowered yet)
        return _attention_math(q, k, v, mask, scale, causal)
    if mask is not None and mask.dim() < 4:  # the kernel takes 2-d or 4-d masks
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    # it reads rows as contiguous (SDPA's dispatcher checks that; calling it directly does
    # not): a transposed operand gave garbage (found by `opweave fuzz`)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q, scale, _ = _positive_scale(q, scale)
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _positive_scale(q, scale):
    """The fused kernel masks before it scales, so a scale of 0 or below turned masked
    scores' -inf into NaN. An equal query and a positive scale for it: (-q) k^T * |scale|
    below 0, (0 q) k^T * 1 at 0 (NaN where q or k holds NaN or inf, as the math form);
    and the factor the kernel's query gradient takes to be the original query's. The
    scale is taken as the kernel takes it, in float32 but for float64 operands (1e-62 is
    0 there)."""
    # rounded in Python (a tensor read back would stop the native plan); below 1, where
    # rounding to float32 cannot overflow
    if q.dtype != torch.float64 and abs(scale) < 1.0:
        scale = float(numpy.float32(scale))
    if scale < 0:
        return -q, -scale, -1.0
    if scale == 0:
        return q * 0.0, 1.0, 0.0
    return q, scale, 1.0


def _attention_math(q, k, v, mask, scale, causal):
    """The unfused form, for shapes the fused kernel cannot take (an empty axis)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:  # top-left aligned, as torch's kernels
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1).to(_lse_dtype(q.dtype))
    return torch.softmax(scores, dim=-1) @ v, lse


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The fused kernel's logsumexp: float32 for half-precision operands."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _attention_flops(ins, outs, attrs):
    return 2 * ins[0].numel * ins[1].shape[2] + 2 * outs[0].numel * ins[1].shape[2]


ATTENTION_ATTRS = {"scale": Attr("float"), "causal": Attr("bool", False)}
define("attention", None, MANY, _attention_shape, _attention_dtype, _attention,
       attrs=ATTENTION_ATTRS, flops=_attention_flops)
# A training step's forward: the backward reads the logsumexp, and with it recomputes the
# probabilities instead of keeping [seq, seq] of them from the forward.
define("attention_lse", None, MANY,
       lambda ins, a: [*_attention_shape(ins, a), ins[0].shape[:3]],
       lambda ins, a: [*_attention_dtype(ins, a), _lse_dtype(ins[0].dtype)],
       _attention_lse, attrs=ATTENTION_ATTRS, flops=_attention_flops)


def _attention_backward_shape(ins, attrs):
    """Gradients of query, key and value; the rest must be what `attention_lse` gave."""
    if len(ins) not in (6, 7):
        raise ShapeError("attention_backward takes the output's gradient, query, key, value, "
                         f"output, logsumexp and an optional mask; got {len(ins)} operands")
    grad, q, k, v, out, lse = ins[:6]
    (expected,) = _attention_shape([q, k, v, *ins[6:]], attrs)
    if tuple(grad.shape) != tuple(expected) or tuple(out.shape) != tuple(expected) \
            or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ShapeError(f"attention_backward: gradient {grad}, output {out} and logsumexp "
                         f"{lse} do not match query {q}, key {k} and value {v}")
    return [q.shape, k.shape, v.shape]


def _attention_backward_dtype(ins, attrs):
    (dtype,) = _attention_dtype(ins[1:4] + ins[6:], attrs)
    if ins[0].dtype != dtype or ins[4].dtype != dtype or ins[5].dtype != _lse_dtype(dtype):
        raise ShapeError(f"attention_backward: gradient {ins[0]}, output {ins[4]} and "
                         f"logsumexp {ins[5]} must match the {dtype} operands")
    return [dtype] * 3


def _attention_backward(grad, q, k, v, out, lse, mask=None, *, scale, causal):
    """Gradients of attention's query, key and value from torch's fused CPU backward,
    which recomputes the probabilities block by block from the logsumexp: it never holds
    a [seq, seq] matrix either (the math form held three per layer: BERT-base's batch 16
    at 512 tokens, 576 MiB) and took a third of the math form's time (BERT-base's layer
    at batch 4: 60 vs 190 ms, two threads)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if 0 in q.shape[1:3] or k.shape[2] == 0 or q.is_cuda:  # (as the forward)
        return _attention_backward_math(grad, q, k, v, out, lse, mask, scale, causal)
    if mask is not None and mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    grad, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous()
                          for t in (grad, q, k, v, out))
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    q, scale, dq_factor = _positive_scale(q, scale)  # (as the forward)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=mask, scale=scale)
    return (dq if dq_factor == 1.0 else dq * dq_factor), dk, dv


def _attention_backward_math(grad, q, k, v, out, lse, mask, scale, causal):
    """P = exp(S - lse); dV = P^T dO; dS = P (dO V^T - rowsum(dO O)); dQ = s dS K;
    dK = s dS^T Q. For the shapes the fused kernel cannot take (an empty axis)."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores + mask
    probs = torch.exp(scores - lse.to(q.dtype).unsqueeze(-1))
    d_scores = probs * (grad @ v.transpose(-2, -1) - (grad * out).sum(-1, keepdim=True))
    return (d_scores @ k) * scale, (d_scores.transpose(-2, -1) @ q) * scale, \
        probs.transpose(-2, -1) @ grad


# attention_lse's backward: five GEMMs' worth where the forward has two.
define("attention_backward", None, MANY, _attention_backward_shape, _attention_backward_dtype,
       _attention_backward, attrs=ATTENTION_ATTRS,
       flops=lambda ins, outs, a: 2.5 * _attention_flops(ins[1:4], outs[:1], a))


def _conv_out_size(size, kernel, stride, pad, dilation):
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def _conv_shape(ins, attrs):
    x, w = ins[0], ins[1]
    spatial = x.rank - 2
    if spatial < 1 or w.rank != x.rank:
        raise ShapeError(f"conv: input {x} and weight {w} must both be rank 3..5")
    for key in ("stride", "padding", "dilation"):
        if len(attrs[key]) != spatial:
            raise ShapeError(f"conv: {key} needs {spatial} values, got {attrs[key]}")
        least = 0 if key == "padding" else 1
        if any(v < least for v in attrs[key]):
            raise ShapeError(f"conv: {key} must be >= {least}, got {attrs[key]}")
    groups = attrs["groups"]
    if groups < 1:
        raise ShapeError(f"conv: groups must be >= 1, got {groups}")
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        raise ShapeError(f"conv: input {x} does not match weight {w} with groups={groups}")
    if len(ins) == 3 and ins[2].shape != (w.shape[0],):
        raise ShapeError(f"conv: bias {ins[2]} must have shape [{w.shape[0]}]")
    out = [_conv_out_size(x.shape[2 + i], w.shape[2 + i], attrs["stride"][i], attrs["padding"][i],
                          attrs["dilation"][i]) for i in range(spatial)]
    if any(o <= 0 for o in out):
        raise ShapeError(f"conv: output would be empty for input {x} and weight {w}")
    if not w.shape[0]:
        raise ShapeError(f"conv: weight {w} has no output channels")
    if 0 in x.shape[2:] and x.shape[0] and x.shape[1]:
        raise ShapeError(f"conv: input {x} has an empty spatial dim but not an empty batch "
                         f"or channel dim (torch refuses it)")
    # torch gives an input without channels an output without channels, whatever the weight
    return [(x.shape[0], w.shape[0] if x.shape[1] else 0, *out)]


def _conv_flops(ins, outs, attrs):
    w = ins[1]
    return 2 * outs[0].numel * math.prod(w.shape[1:])


def _conv(x, weight, bias=None, *, stride, padding, dilation, groups):
    """N-d convolution (N = 1, 2, 3) with an optional bias."""
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False,
                                      [0] * len(stride), groups)


_CONV_ATTRS = {"stride": Attr("ints"), "padding": Attr("ints"), "dilation": Attr("ints"),
               "groups": Attr("int", 1)}
define("conv", None, MANY, _conv_shape, _same_float_dtype, _conv, attrs=_CONV_ATTRS,
       flops=_conv_flops)


def _conv_transpose_shape(ins, attrs):
    """The shapes torch's transposed convolution gives and accepts: weight
    [C_in, C_out / groups, *kernel], output size (in - 1) * stride - 2 * padding +
    dilation * (kernel - 1) + output_padding + 1, output_padding below the stride or the
    dilation."""
    x, w = ins[0], ins[1]
    spatial = x.rank - 2
    if spatial < 1 or w.rank != x.rank:
        raise ShapeError(f"conv_transpose: input {x} and weight {w} must both be rank 3..5")
    for key in ("stride", "padding", "dilation", "output_padding"):
        if len(attrs[key]) != spatial:
            raise ShapeError(f"conv_transpose: {key} needs {spatial} values, got {attrs[key]}")
        least = 0 if key in ("padding", "output_padding") else 1
        if any(v < least for v in attrs[key]):
            raise ShapeError(f"conv_transpose: {key} must be >= {least}, got {attrs[key]}")
    if any(p >= max(s, d) for p, s, d in zip(attrs["output_padding"], attrs["stride"],
                                             attrs["dilation"])):
        raise ShapeError(f"conv_transpose: output_padding {attrs['output_padding']} must be "
                         f"below the stride {attrs['stride']} or the dilation "
                         f"{attrs['dilation']}")
    groups = attrs["groups"]
    if groups < 1 or x.shape[1] != w.shape[0] or w.shape[0] % groups or not w.shape[1]:
        raise ShapeError(f"conv_transpose: input {x} does not match weight {w} "
                         f"with groups={groups}")
    cout = w.shape[1] * groups
    if len(ins) == 3 and ins[2].shape != (cout,):
        raise ShapeError(f"conv_transpose: bias {ins[2]} must have shape [{cout}]")
    out = [(x.shape[2 + i] - 1) * attrs["stride"][i] - 2 * attrs["padding"][i]
           + attrs["dilation"][i] * (w.shape[2 + i] - 1) + attrs["output_padding"][i] + 1
           for i in range(spatial)]
    if any(isinstance(o, int) and o <= 0 for o in out) or \
            any(isinstance(d, int) and d < 1 for d in x.shape[2:]):
        raise ShapeError(f"conv_transpose: output would be empty for input {x} and weight {w}")
    return [(x.shape[0], cout, *out)]


def _conv_transpose(x, weight, bias=None, *, stride, padding, output_padding, dilation, groups):
    """N-d transposed convolution (N = 1, 2, 3; the gradient of conv with respect to its
    input, as a layer: decoders' learned upsampling) with an optional bias."""
    return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, True,
                                      output_padding, groups)


_CONV_TRANSPOSE_ATTRS = {**_CONV_ATTRS, "output_padding": Attr("ints")}
define("conv_transpose", None, MANY, _conv_transpose_shape, _same_float_dtype, _conv_transpose,
       attrs=_CONV_TRANSPOSE_ATTRS,
       flops=lambda ins, outs, a: 2 * ins[0].numel * math.prod(ins[1].shape[1:]))


def _conv_transpose_backward_shape(ins, attrs):
    grad, x, w = ins
    (out,) = _conv_transpose_shape([x, w], attrs)
    if tuple(grad.shape) != tuple(out):
        raise ShapeError(f"conv_transpose_backward: grad {grad} is not the shape conv_transpose "
                         f"gives for input {x} and weight {w} ({list(out)})")
    shapes = [x.shape, w.shape, (out[1],)]
    return [s for s, keep in zip(shapes, attrs["output_mask"]) if keep]


def _conv_transpose_backward(grad, x, weight, *, stride, padding, output_padding, dilation,
                             groups, output_mask):
    """Gradients of conv_transpose for input, weight and bias, those `output_mask` selects."""
    return _gradients(grad, x, weight, [weight.shape[1] * groups], stride, padding, dilation,
                      True, output_padding, groups, output_mask)


def _gradients(grad, x, weight, bias_size, stride, padding, dilation, transposed,
               output_padding, groups, output_mask):
    """torch's convolution backward, with only the gradients `output_mask` selects."""
    outs = torch.ops.aten.convolution_backward(
        grad, x, weight, bias_size, stride, padding, dilation, transposed, output_padding,
        groups, [bool(m) for m in output_mask])
    kept = [o for o, keep in zip(outs, output_mask) if keep]
    return kept[0] if len(kept) == 1 else tuple(kept)


define("conv_transpose_backward", 3, MANY, _conv_transpose_backward_shape,
       lambda ins, a: [ins[0].dtype] * sum(map(bool, a["output_mask"])), _conv_transpose_backward,
       attrs={**_CONV_TRANSPOSE_ATTRS, "output_mask": Attr("ints", [1, 1, 1])},
       flops=lambda ins, outs, a: 4 * ins[1].numel * math.prod(ins[2].shape[1:]))


def _conv_backward_shape(ins, attrs):
    """The forward conv's rules hold (strides, dilations, groups, shapes), and `grad` has
    the shape that conv gives."""
    grad, x, w = ins
    (out,) = _conv_shape([x, w], attrs)
    if tuple(grad.shape) != tuple(out):
        raise ShapeError(f"conv_backward: grad {grad} is not the shape conv gives for input {x} "
                         f"and weight {w} ({list(out)})")
    mask = attrs["output_mask"]
    shapes = [x.shape, w.shape, (w.shape[0],)]
    return [s for s, keep in zip(shapes, mask) if keep]


def _conv_backward(grad, x, weight, *, stride, padding, dilation, groups, output_mask):
    """Gradients of conv for input, weight and bias, those selected by `output_mask`."""
    return _gradients(grad, x, weight, [weight.shape[0]], stride, padding, dilation, False,
                      [0] * len(stride), groups, output_mask)


define("conv_backward", 3, MANY, _conv_backward_shape,
       lambda ins, a: [ins[0].dtype] * sum(map(bool, a["output_mask"])), _conv_backward,
       attrs={**_CONV_ATTRS, "output_mask": Attr("ints", [1, 1, 1])},
       flops=lambda ins, outs, a: 4 * ins[0].numel * math.prod(ins[2].shape[1:]))


def _sparse_mm_shape(ins, attrs):
    indices, values, dense = ins
    if indices.rank != 2 or indices.shape[0] != 2 or values.shape != (indices.shape[1],):
        raise ShapeError(f"sparse_mm: COO indices {indices} / values {values} are malformed")
    if dense.rank != 2 or dense.shape[0] != attrs["cols"]:
        raise ShapeError(f"sparse_mm: [{attrs['rows']},{attrs['cols']}] sparse @ {dense}")
    return [(attrs["rows"], dense.shape[1])]


def _sparse_mm_dtype(ins, attrs):
    if ins[0].dtype != torch.int64:
        raise ShapeError(f"sparse_mm: indices must be i64, got {ins[0]}")
    if ins[1].dtype != ins[2].dtype:
        raise ShapeError(f"sparse_mm: values {ins[1]} and dense {ins[2]} differ in dtype")
    return [ins[2].dtype]


def _sparse_mm(indices, values, dense, *, rows, cols):
    """Sparse (COO, coalesced) times dense matrix: the GCN propagation step."""
    sparse = torch.sparse_coo_tensor(indices, values, (rows, cols), is_coalesced=True,
                                     check_invariants=False)
    return torch.sparse.mm(sparse, dense)


define("sparse_mm", 3, MANY, _sparse_mm_shape, _sparse_mm_dtype, _sparse_mm,
       attrs={"rows": Attr("int"), "cols": Attr("int")},
       flops=lambda ins, outs, a: 2 * ins[1].numel * ins[2].shape[1])
