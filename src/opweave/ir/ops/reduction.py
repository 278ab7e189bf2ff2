"""Reductions and normalizations (many-to-many): sum, mean, amax, any, softmax, norms."""
from __future__ import annotations

import torch

from ._common import (Attr, MappingType, ShapeError, define, norm_dim, per_input_element,
                      same_shape)

MANY = MappingType.MANY_TO_MANY


def _reduced_shape(ins, attrs):
    shape = ins[0].shape
    dims = {norm_dim(d, len(shape)) for d in attrs["dims"]}
    if not dims and shape:
        raise ShapeError("reduction over no dims: list every dim to reduce all of them")
    if attrs["keepdim"]:
        return [tuple(1 if i in dims else s for i, s in enumerate(shape))]
    return [tuple(s for i, s in enumerate(shape) if i not in dims)]


def _sum_dtype(ins, attrs):
    dtype = ins[0].dtype
    return [dtype if dtype.is_floating_point else torch.int64]


def _mean_dtype(ins, attrs):
    if not ins[0].dtype.is_floating_point:
        raise ShapeError(f"mean needs a floating-point input, got {ins[0]}")
    return [ins[0].dtype]


def column_sum_axes(shape, dims) -> bool:
    """Whether a sum over `dims` of a `shape` tensor sums each column: every axis but the
    last is reduced or of size 1, and the last is kept (a bias gradient)."""
    rank = len(shape)
    return (rank >= 2 and rank - 1 not in dims
            and all(d in dims or shape[d] == 1 for d in range(rank - 1)))


def _dims(x, dims):
    return list(dims) if x.dim() else []


def _sum(x, dims, keepdim):
    """Sum over `dims`."""
    return torch.sum(x, _dims(x, dims), keepdim=keepdim)


def _mean(x, dims, keepdim):
    """Mean over `dims`."""
    return torch.mean(x, _dims(x, dims), keepdim=keepdim)


def _amax(x, dims, keepdim):
    """Maximum over `dims` (values only)."""
    return torch.amax(x, _dims(x, dims), keepdim=keepdim)


def _amin(x, dims, keepdim):
    """Minimum over `dims` (values only)."""
    return torch.amin(x, _dims(x, dims), keepdim=keepdim)


def _any(x, dims, keepdim):
    """Logical or over `dims`."""
    out = x.bool()
    for d in sorted({d % max(x.dim(), 1) for d in dims}, reverse=True) if x.dim() else []:
        out = out.any(d, keepdim=keepdim)
    return out


_REDUCE_ATTRS = {"dims": Attr("ints"), "keepdim": Attr("bool", False)}
define("sum", 1, MANY, _reduced_shape, _sum_dtype, _sum, attrs=_REDUCE_ATTRS,
       flops=per_input_element(1))
define("mean", 1, MANY, _reduced_shape, _mean_dtype, _mean, attrs=_REDUCE_ATTRS,
       flops=per_input_element(1))
define("amax", 1, MANY, _reduced_shape, lambda ins, a: [ins[0].dtype], _amax,
       attrs=_REDUCE_ATTRS, flops=per_input_element(1))
define("amin", 1, MANY, _reduced_shape, lambda ins, a: [ins[0].dtype], _amin,
       attrs=_REDUCE_ATTRS, flops=per_input_element(1))
define("any", 1, MANY, _reduced_shape, lambda ins, a: [torch.bool], _any,
       attrs=_REDUCE_ATTRS, flops=per_input_element(1))


def _float_same(ins, attrs):
    if not ins[0].dtype.is_floating_point:
        raise ShapeError(f"needs a floating-point input, got {ins[0]}")
    norm_dim(attrs.get("dim", 0), ins[0].rank)
    return [ins[0].dtype]


def _softmax(x, dim):
    """Numerically stable softmax along `dim`."""
    return torch.softmax(x, dim)


def _log_softmax(x, dim):
    """Numerically stable log-softmax along `dim`."""
    return torch.log_softmax(x, dim)


define("softmax", 1, MANY, same_shape, _float_same, _softmax, attrs={"dim": Attr("int")},
       flops=per_input_element(5),
       impl_out=lambda ins, a, out: torch.ops.aten._softmax.out(ins[0], a["dim"], False, out=out))
define("log_softmax", 1, MANY, same_shape, _float_same, _log_softmax, attrs={"dim": Attr("int")},
       flops=per_input_element(5))


def _cumsum_dtype(ins, attrs):
    norm_dim(attrs["dim"], max(ins[0].rank, 1))
    dtype = ins[0].dtype
    return [dtype if dtype.is_floating_point else torch.int64]  # as torch promotes


def _cumsum(x, dim):
    """Running sum along `dim` (integers and booleans sum as int64, as in torch)."""
    return torch.cumsum(x, dim, dtype=None if x.is_floating_point() else torch.int64)


define("cumsum", 1, MANY, same_shape, _cumsum_dtype, _cumsum, attrs={"dim": Attr("int")},
       flops=per_input_element(1))


def _layer_norm_shapes(ins, attrs):
    x, weight, bias = ins
    normalized = tuple(attrs["normalized_shape"])
    if tuple(x.shape[len(x.shape) - len(normalized):]) != normalized or len(normalized) > x.rank:
        raise ShapeError(f"layer_norm: input {x} does not end in normalized_shape {list(normalized)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != normalized:
            raise ShapeError(f"layer_norm: {name} {t} must have shape {list(normalized)}")
    stats = tuple(x.shape[: x.rank - len(normalized)]) + (1,) * len(normalized)
    return [x.shape, stats, stats]


def _layer_norm(x, weight, bias, normalized_shape, eps):
    """Layer normalization; also returns the mean and reciprocal std (for the backward)."""
    return torch.ops.aten.native_layer_norm(x, normalized_shape, weight, bias, eps)


define("layer_norm", 3, MANY, _layer_norm_shapes, lambda ins, a: _float_same(ins, a) * 3,
       _layer_norm, attrs={"normalized_shape": Attr("ints"), "eps": Attr("float", 1e-5)},
       flops=per_input_element(8))


def _batch_norm_shape(ins, attrs):
    x = ins[0]
    if x.rank < 2:
        raise ShapeError(f"batch_norm needs rank >= 2, got {x}")
    for t in ins[1:]:
        if t.shape != (x.shape[1],):
            raise ShapeError(f"batch_norm: per-channel input {t} must have shape [{x.shape[1]}]")
    return [x.shape]


def _norm_dtypes(count):
    """Batch norm's operands are all floating point (torch's kernels assume it)."""
    def rule(ins, attrs):
        if not all(t.dtype.is_floating_point for t in ins):
            raise ShapeError(f"batch norm needs floating-point operands, got {', '.join(map(str, ins))}")
        return [ins[0].dtype] * count
    return rule


def _batch_norm(x, weight, bias, mean, var, eps):
    """Batch normalization with fixed statistics (inference)."""
    return torch.nn.functional.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)


# With fixed statistics each output element depends on one input element: one-to-one.
define("batch_norm", 5, MappingType.ONE_TO_ONE, _batch_norm_shape, _norm_dtypes(1), _batch_norm,
       attrs={"eps": Attr("float", 1e-5)}, flops=per_input_element(2))


# Training-mode batch norm stays one op each way: its statistics reduce over every axis
# but the channel, which no generated kernel fuses, and ATen's kernels do each direction
# in one or two passes where the primitives take six (measured: ResNet-50's step 14%
# slower decomposed).
def _batch_norm_train_shapes(ins, attrs):
    (x_shape,) = _batch_norm_shape(ins, attrs)
    channel = (x_shape[1],)
    return [x_shape, channel, channel, channel, channel]


def _batch_norm_train(x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm over batch statistics: output, saved mean and inverse std, and the
    updated running mean and variance (functional: the old ones are not written)."""
    return torch.ops.aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)


define("batch_norm_train", 5, MappingType.MANY_TO_MANY, _batch_norm_train_shapes,
       _norm_dtypes(5), _batch_norm_train,
       attrs={"momentum": Attr("float", 0.1), "eps": Attr("float", 1e-5)},
       flops=per_input_element(6))


def _batch_norm_backward_shapes(ins, attrs):
    grad, x, weight, mean, invstd = ins
    if not x.numel:  # torch 2.13's CPU kernel dies of SIGFPE on one, killing the process
        raise ShapeError(f"batch_norm_backward of an empty input {x}")
    if grad.shape != x.shape:
        raise ShapeError(f"batch_norm_backward: gradient {grad} does not match input {x}")
    _batch_norm_shape([x, weight, mean, invstd], attrs)
    channel = (x.shape[1],)
    return [x.shape, channel, channel]


def _batch_norm_backward(grad, x, weight, mean, invstd, eps):
    """Gradients of training-mode batch norm: input, weight, bias."""
    return torch.ops.aten.native_batch_norm_backward(
        grad, x, weight, None, None, mean, invstd, True, eps, [True, True, True])


define("batch_norm_backward", 5, MappingType.MANY_TO_MANY, _batch_norm_backward_shapes,
       _norm_dtypes(3), _batch_norm_backward,
       attrs={"eps": Attr("float", 1e-5)}, flops=per_input_element(8))
