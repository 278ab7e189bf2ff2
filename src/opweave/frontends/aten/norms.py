"""Reductions and normalizations: sums, softmax, cumsum, layer, group and batch norm."""
from __future__ import annotations

import torch

from ..lowering import Unsupported, lowers
from .common import _dims, _shape, aten, reads_output
from .layout import reshape

# -- reductions and normalization --------------------------------------------------------------
def _reduce(op):
    def rule(ctx, x, dims=None, keepdim=False, dtype=None):
        v = ctx.value(x)
        if dtype is not None and dtype != v.type.dtype:
            v = ctx.add1("cast", [v], {"dtype": dtype})
        return ctx.add1(op, [v], {"dims": _dims(dims, v.type.rank), "keepdim": keepdim})
    return rule


lowers(aten.sum.dim_IntList)(_reduce("sum"))
lowers(aten.mean.dim)(_reduce("mean"))
lowers(aten.amax.default)(_reduce("amax"))
lowers(aten.amin.default)(_reduce("amin"))
lowers(aten.any.dim, aten.any.dims)(_reduce("any"))


@lowers(aten.sum.default, aten.mean.default, aten.any.default)
def _reduce_all(ctx, x, dtype=None):
    op = {aten.sum.default: "sum", aten.mean.default: "mean", aten.any.default: "any"}[ctx.node.target]
    return _reduce(op)(ctx, x, None, False, dtype)


@lowers(aten._softmax.default, aten._log_softmax.default)
def _softmax(ctx, x, dim, half_to_float):
    if half_to_float:
        raise Unsupported("softmax with half_to_float")
    v = ctx.value(x)
    op = "softmax" if ctx.node.target is aten._softmax.default else "log_softmax"
    if v.type.rank == 0:  # torch treats a 0-d tensor as one element along dim 0 or -1
        return reshape(ctx, ctx.add1(op, [reshape(ctx, v, [1])], {"dim": 0}), [])
    return ctx.add1(op, [v], {"dim": dim % v.type.rank})


@lowers(aten.cumsum.default)
def _cumsum(ctx, x, dim, dtype=None):
    """Running sum (position ids from a padding mask in RoBERTa, OPT, Llama, ...)."""
    v = ctx.value(x)
    if v.type.rank == 0:
        raise Unsupported("cumsum of a 0-d tensor")
    if dtype is not None and dtype != v.type.dtype:  # torch sums in `dtype`
        v = ctx.add1("cast", [v], {"dtype": dtype})
    return ctx.add1("cumsum", [v], {"dim": dim % v.type.rank})


def _ones_or(ctx, node, shape, dtype, value):
    if node is not None:
        return ctx.value(node)
    return ctx.add1("full", [], {"shape": list(shape), "value": value, "dtype": dtype})


@lowers(aten.native_layer_norm.default)
def _layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    v = ctx.value(x)
    w = _ones_or(ctx, weight, normalized_shape, v.type.dtype, 1.0)
    b = _ones_or(ctx, bias, normalized_shape, v.type.dtype, 0.0)
    return ctx.add("layer_norm", [v, w, b], {"normalized_shape": list(normalized_shape), "eps": eps})


@lowers(aten.native_group_norm.default)
def _group_norm(ctx, x, weight, bias, n, channels, spatial, groups, eps):
    """Group norm as a layer norm over each group's elements ([N, G, C/G * HxW]), then the
    per-channel affine map; mean and rstd come out as [N, G], as torch returns them."""
    v = ctx.value(x)
    shape = _shape(v)
    width = channels // groups * spatial
    normed, mean, rstd = _layer_norm_of(ctx, reshape(ctx, v, [n, groups, width]), [width], eps)
    out = reshape(ctx, normed, shape)
    per_channel = [channels] + [1] * (len(shape) - 2)
    if weight is not None:
        out = ctx.add1("mul", [out, reshape(ctx, ctx.value(weight), per_channel)])
    if bias is not None:
        out = ctx.add1("add", [out, reshape(ctx, ctx.value(bias), per_channel)])
    return [out, reshape(ctx, mean, [n, groups]), reshape(ctx, rstd, [n, groups])]


def _layer_norm_of(ctx, v, normalized_shape, eps):
    ones = ctx.add1("full", [], {"shape": normalized_shape, "value": 1.0, "dtype": v.type.dtype})
    zeros = ctx.add1("full", [], {"shape": normalized_shape, "value": 0.0, "dtype": v.type.dtype})
    return ctx.add("layer_norm", [v, ones, zeros],
                   {"normalized_shape": normalized_shape, "eps": eps})


@lowers(aten.linalg_vector_norm.default)
def _vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """The Euclidean norm (weight normalization): sqrt(sum(x * x))."""
    v = ctx.value(x)
    if ord != 2 or dtype is not None or not v.type.dtype.is_floating_point:
        raise Unsupported("vector norms other than the float 2-norm")
    dims = _dims(dim, v.type.rank)
    squares = ctx.add1("mul", [v, v])
    total = ctx.add1("sum", [squares], {"dims": dims, "keepdim": keepdim}) if dims else squares
    return ctx.add1("sqrt", [total])


@lowers(aten._native_batch_norm_legit_no_training.default)
def _batch_norm(ctx, x, weight, bias, mean, var, momentum, eps):
    v = ctx.value(x)
    channels = [v.type.shape[1]]
    w = _ones_or(ctx, weight, channels, v.type.dtype, 1.0)
    b = _ones_or(ctx, bias, channels, v.type.dtype, 0.0)
    out = ctx.add1("batch_norm", [v, w, b, ctx.value(mean), ctx.value(var)], {"eps": eps})
    if not any(reads_output(ctx.node, i) for i in (1, 2)):
        return [out, None, None]  # (CUDA's kernel returns statistics where the CPU's has none)
    # ATen returns empty saved statistics in eval mode; the backward reads the running ones
    empty = ctx.graph.add_constant("empty_stats", torch.empty(0, dtype=v.type.dtype))
    return [out, empty, empty]


@lowers(aten._native_batch_norm_legit_functional.default)
def _batch_norm_train(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        raise Unsupported("functional batch norm outside training")
    if weight is None or bias is None or running_mean is None or running_var is None:
        raise Unsupported("training batch norm without affine weights or running statistics")
    ins = [ctx.value(t) for t in (x, weight, bias, running_mean, running_var)]
    return ctx.add("batch_norm_train", ins, {"momentum": float(momentum), "eps": float(eps)})


@lowers(aten.native_batch_norm_backward.default)
def _batch_norm_backward(ctx, grad, x, weight, running_mean, running_var, save_mean,
                         save_invstd, train, eps, output_mask):
    if weight is None:
        raise Unsupported("batch norm backward without affine weights")
    if train:
        ins = [ctx.value(t) for t in (grad, x, weight, save_mean, save_invstd)]
        outs = ctx.add("batch_norm_backward", ins, {"eps": float(eps)})
    else:
        outs = _batch_norm_eval_backward(ctx, grad, x, weight, running_mean, running_var, eps)
    return [o if wanted else None for o, wanted in zip(outs, output_mask)]


def _batch_norm_eval_backward(ctx, grad, x, weight, running_mean, running_var, eps):
    """With fixed statistics batch norm is a per-channel affine map: its gradients are
    pointwise products and sums over all axes but the channel."""
    g, v = ctx.value(grad), ctx.value(x)
    per_channel = [1, v.type.shape[1]] + [1] * (v.type.rank - 2)
    others = [d for d in range(v.type.rank) if d != 1]

    def channel(t):
        return reshape(ctx, t, per_channel)
    invstd = ctx.add1("rsqrt", [ctx.add1("add", [ctx.value(running_var),
                                                 ctx.scalar(float(eps), like=v)])])
    scale = ctx.add1("mul", [ctx.value(weight), invstd])
    grad_input = ctx.add1("mul", [g, channel(scale)])
    centered = ctx.add1("sub", [v, channel(ctx.value(running_mean))])
    normalized = ctx.add1("mul", [centered, channel(invstd)])
    grad_weight = ctx.add1("sum", [ctx.add1("mul", [g, normalized])], {"dims": others, "keepdim": False})
    grad_bias = ctx.add1("sum", [g], {"dims": others, "keepdim": False})
    return [grad_input, grad_weight, grad_bias]


@lowers(aten.native_batch_norm.default)
def _native_batch_norm(ctx, x, weight, bias, mean, var, training, momentum, eps):
    if training:
        raise Unsupported("batch norm in training mode (batch statistics)")
    return _batch_norm(ctx, x, weight, bias, mean, var, momentum, eps)
