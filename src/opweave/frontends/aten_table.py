"""The ATen table: how each supported ATen overload lowers into IR ops.

Composites decompose here where that loses nothing (addmm -> matmul + add, embedding ->
index_select, select/squeeze/unsqueeze -> slice/reshape). A rule raises `Unsupported` for
uses it cannot express, and that node then runs in eager PyTorch.
"""
from __future__ import annotations

import operator

import torch

from .lowering import Unsupported, lowers

aten = torch.ops.aten
MAX_INDEX = 2**63 - 1


def _shape(v):
    return list(v.type.shape)


def _dims(dims, rank):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(rank, 1) for d in dims}) if rank else []


# -- identity-like ---------------------------------------------------------------------------
@lowers(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
        aten.contiguous.default)
def _identity(ctx, x, *args, **kwargs):
    return ctx.value(x)


@lowers(aten._assert_tensor_metadata.default)
def _assert_tensor_metadata(ctx, x, size=None, stride=None, dtype=None, *, device=None,
                            layout=None):
    """torch.export's check of a tensor's dtype (from `.to()` calls): every IR type is
    static, so a check that holds here holds on every call (the compiled model guards its
    inputs' types); one that fails runs in eager, where it raises."""
    v = ctx.value(x)
    if (dtype is not None and dtype != v.type.dtype) or \
            (size is not None and list(size) != _shape(v)) or \
            (device is not None and torch.device(device).type != "cpu"):
        raise Unsupported("the asserted metadata differs from the traced tensor's")
    return None


@lowers(operator.getitem)
def _getitem(ctx, source, index):
    produced = ctx.values.get(source)
    if not isinstance(produced, (list, tuple)):
        raise Unsupported("getitem of a value that is not a tuple")
    if produced[index] is None and ctx.node.users:
        raise Unsupported(f"output {index} of {source.name} has no IR lowering")
    return produced[index]


# -- elementwise -------------------------------------------------------------------------------
_UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.exp.default: "exp",
    aten.log.default: "log", aten.log1p.default: "log1p", aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal",
    aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh", aten.erf.default: "erf",
    aten.relu.default: "relu", aten.sin.default: "sin", aten.cos.default: "cos",
    aten.logical_not.default: "logical_not",
}
for _target, _op in _UNARY.items():
    lowers(_target)(lambda ctx, x, _op=_op: ctx.add1(_op, [ctx.value(x)]))


@lowers(aten.bitwise_not.default)
def _bitwise_not(ctx, x):
    v = ctx.value(x)
    if v.type.dtype != torch.bool:
        raise Unsupported("bitwise_not on integers")
    return ctx.add1("logical_not", [v])


@lowers(aten.gelu.default)
def _gelu(ctx, x, approximate="none"):
    return ctx.add1("gelu", [ctx.value(x)], {"approximate": approximate})


@lowers(aten.clamp.default)
def _clamp(ctx, x, min=None, max=None):
    return ctx.add1("clamp", [ctx.value(x)], {"min": min, "max": max})


@lowers(aten.clamp_min.default)
def _clamp_min(ctx, x, min):
    return _clamp(ctx, x, min=min)


@lowers(aten.clamp_max.default)
def _clamp_max(ctx, x, max):
    return _clamp(ctx, x, max=max)


def _operands(ctx, a, b):
    """IR values for two operands, numbers typed as torch promotes them against the tensor."""
    if not hasattr(a, "op") and not hasattr(b, "op"):
        raise Unsupported("both operands are numbers")
    va = ctx.value(a) if hasattr(a, "op") else None
    vb = ctx.value(b) if hasattr(b, "op") else None
    return (va or ctx.scalar(a, vb)), (vb or ctx.scalar(b, va))


def _with_alpha(ctx, op, a, b, alpha):
    va, vb = _operands(ctx, a, b)
    if alpha != 1:
        vb = ctx.add1("mul", [vb, ctx.scalar(alpha, vb)])
    return ctx.add1(op, [va, vb])


@lowers(aten.add.Tensor, aten.add.Scalar)
def _add(ctx, a, b, alpha=1):
    return _with_alpha(ctx, "add", a, b, alpha)


@lowers(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx, a, b, alpha=1):
    return _with_alpha(ctx, "sub", a, b, alpha)


@lowers(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(ctx, a, b, alpha=1):
    return _with_alpha(ctx, "sub", b, a, alpha) if alpha == 1 else _sub(ctx, b, a, alpha)


_BINARY = {
    "mul": (aten.mul.Tensor, aten.mul.Scalar),
    "maximum": (aten.maximum.default,),
    "minimum": (aten.minimum.default,),
    "pow": (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar),
    "eq": (aten.eq.Tensor, aten.eq.Scalar), "ne": (aten.ne.Tensor, aten.ne.Scalar),
    "lt": (aten.lt.Tensor, aten.lt.Scalar), "le": (aten.le.Tensor, aten.le.Scalar),
    "gt": (aten.gt.Tensor, aten.gt.Scalar), "ge": (aten.ge.Tensor, aten.ge.Scalar),
    "logical_and": (aten.logical_and.default,), "logical_or": (aten.logical_or.default,),
}
for _op, _targets in _BINARY.items():
    lowers(*_targets)(lambda ctx, a, b, _op=_op: ctx.add1(_op, list(_operands(ctx, a, b))))


@lowers(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor)
def _bitwise(ctx, a, b):
    va, vb = _operands(ctx, a, b)
    if va.type.dtype != torch.bool or vb.type.dtype != torch.bool:
        raise Unsupported("bitwise and/or on integers")
    op = "logical_and" if ctx.node.target is aten.bitwise_and.Tensor else "logical_or"
    return ctx.add1(op, [va, vb])


@lowers(aten.div.Tensor, aten.div.Scalar)
def _div(ctx, a, b):
    return ctx.add1("div", list(_operands(ctx, a, b)))


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(ctx, a, b, rounding_mode=None):
    return ctx.add1("div", list(_operands(ctx, a, b)), {"rounding": rounding_mode or "none"})


@lowers(aten.where.self)
def _where(ctx, cond, a, b):
    va, vb = _operands(ctx, a, b)
    return ctx.add1("where", [ctx.value(cond), va, vb])


@lowers(aten._to_copy.default)
def _to_copy(ctx, x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    v = ctx.value(x)
    if device is not None and torch.device(device).type != "cpu":
        raise Unsupported(f"copy to {device}")
    if layout not in (None, torch.strided):
        raise Unsupported(f"copy to {layout}")
    return ctx.add1("cast", [v], {"dtype": dtype or v.type.dtype})


@lowers(aten._assert_tensor_metadata.default)
def _assert_tensor_metadata(ctx, x, size=None, stride=None, dtype=None, *, device=None,
                            layout=None):
    """torch.export's check before each `.to()`: decided from the static type, it lowers
    to nothing. A check the type cannot decide, or one that fails, runs in eager (where a
    failing one raises as it would have)."""
    t = ctx.value(x).type
    if stride is not None or (size is not None and list(size) != list(t.shape)) \
            or (dtype is not None and dtype != t.dtype) \
            or (device is not None and torch.device(device).type != "cpu") \
            or layout not in (None, torch.strided):
        raise Unsupported("a metadata check the static type does not settle")
    return None


# -- creation --------------------------------------------------------------------------------
def _default_dtype(value):
    return torch.tensor(value).dtype if not isinstance(value, float) else torch.get_default_dtype()


@lowers(aten.scalar_tensor.default)
def _scalar_tensor(ctx, value, dtype=None, layout=None, device=None, pin_memory=None):
    return ctx.scalar(value, dtype=dtype or torch.get_default_dtype())


@lowers(aten.full.default)
def _full(ctx, size, value, dtype=None, layout=None, device=None, pin_memory=None):
    return ctx.add1("full", [], {"shape": list(size), "value": value,
                                 "dtype": dtype or _default_dtype(value)})


@lowers(aten.zeros.default, aten.ones.default)
def _zeros_ones(ctx, size, dtype=None, layout=None, device=None, pin_memory=None):
    value = 1 if ctx.node.target is aten.ones.default else 0
    return ctx.add1("full", [], {"shape": list(size), "value": value,
                                 "dtype": dtype or torch.get_default_dtype()})


@lowers(aten.full_like.default)
def _full_like(ctx, x, value, dtype=None, layout=None, device=None, pin_memory=None,
               memory_format=None):
    v = ctx.value(x)
    return ctx.add1("full", [], {"shape": _shape(v), "value": value, "dtype": dtype or v.type.dtype})


@lowers(aten.zeros_like.default, aten.ones_like.default)
def _zeros_ones_like(ctx, x, dtype=None, layout=None, device=None, pin_memory=None,
                     memory_format=None):
    value = 1 if ctx.node.target is aten.ones_like.default else 0
    return _full_like(ctx, x, value, dtype)


@lowers(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(ctx, *args, dtype=None, layout=None, device=None, pin_memory=None):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    if dtype is None:
        dtype = torch.int64 if all(isinstance(a, int) for a in (start, end, step)) \
            else torch.get_default_dtype()
    return ctx.add1("arange", [], {"start": start, "end": end, "step": step, "dtype": dtype})


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
    end = MAX_INDEX if end is None else min(end, MAX_INDEX)
    if start == 0 and end >= v.type.shape[dim] and step == 1:
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
    index = index % v.type.shape[dim]
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
    if transposed:
        raise Unsupported("transposed convolution")
    inputs = [ctx.value(x), ctx.value(weight)] + ([ctx.value(bias)] if bias is not None else [])
    spatial = inputs[0].type.rank - 2

    def per_dim(v):  # torch broadcasts one value to every spatial dim (padding="valid": [0])
        return list(v) * spatial if len(v) == 1 else list(v)

    return ctx.add1("conv", inputs, {"stride": per_dim(stride), "padding": per_dim(padding),
                                     "dilation": per_dim(dilation), "groups": groups})


@lowers(aten.hardtanh.default)
def _hardtanh(ctx, x, min_val=-1.0, max_val=1.0):
    """ReLU6 (MobileNetV2) is hardtanh(0, 6)."""
    return ctx.add1("clamp", [ctx.value(x)], {"min": min_val, "max": max_val})


@lowers(aten.avg_pool2d.default)
def _avg_pool2d(ctx, x, kernel, stride=None, padding=0, ceil_mode=False,
                count_include_pad=True, divisor_override=None):
    """Average pooling over windows that tile the input (kernel = stride, no padding):
    a mean over the split axes. Overlapping or padded windows run in eager."""
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
    if stride != kernel or any(padding) or divisor_override is not None:
        raise Unsupported("average pooling over overlapping or padded windows")
    if any(size % k for size, k in zip(shape[-2:], kernel)):
        raise Unsupported("average pooling windows that do not tile the input")
    return _tile_mean(ctx, v, kernel)


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


@lowers(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    """Padding (pairs of before/after counts from the last dim backwards) as a cat with
    constant blocks; negative counts crop."""
    v = ctx.value(x)
    for i in range(len(pad) // 2):
        dim = v.type.rank - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            size = v.type.shape[dim]
            v = ctx.add1("slice", [v], {"dim": dim, "start": max(-before, 0),
                                        "end": size - max(-after, 0), "step": 1})
            before, after = max(before, 0), max(after, 0)
        parts = []
        for count, at_end in ((before, False), (after, True)):
            if count:
                shape = _shape(v)
                shape[dim] = count
                block = ctx.add1("full", [], {"shape": shape, "value": value,
                                              "dtype": v.type.dtype})
                parts.append((at_end, block))
        if parts:
            pieces = [b for end, b in parts if not end] + [v] + [b for end, b in parts if end]
            v = ctx.add1("cat", pieces, {"dim": dim})
    return v


@lowers(aten.convolution_backward.default)
def _convolution_backward(ctx, grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    if transposed:
        raise Unsupported("transposed convolution")
    mask = [int(bool(m)) for m in output_mask]
    outs = iter(ctx.add("conv_backward", [ctx.value(grad), ctx.value(x), ctx.value(weight)],
                        {"stride": list(stride), "padding": list(padding),
                         "dilation": list(dilation), "groups": groups, "output_mask": mask}))
    return [next(outs) if m else None for m in mask]


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _flash_attention(ctx, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                     scale=None):
    """Attention in its math form; also the logsumexp of the scores, which the fused
    backward reads (so a backward that falls back to eager still gets what it expects)."""
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    scale, scores = _attention_scores(ctx, q, k, dropout_p, is_causal, attn_mask, scale)
    peak = ctx.add1("amax", [scores], {"dims": [3], "keepdim": True})
    shifted = ctx.add1("exp", [ctx.add1("sub", [scores, peak])])
    total = ctx.add1("sum", [shifted], {"dims": [3], "keepdim": True})
    probs = ctx.add1("div", [shifted, total])
    out = ctx.add1("matmul", [probs, v])
    logsumexp = ctx.add1("add", [ctx.add1("log", [total]), peak])
    return [out, reshape(ctx, logsumexp, _shape(logsumexp)[:3])]


def _attention_scores(ctx, q, k, dropout_p, is_causal, attn_mask, scale):
    """scale * q @ k^T with the causal and explicit masks applied (masked = -inf)."""
    if dropout_p != 0.0:
        raise Unsupported("attention dropout")
    if q.type.rank != 4 or q.type.shape[1] != k.type.shape[1]:
        raise Unsupported("attention other than [batch, heads, seq, dim] with equal head counts")
    length, source = q.type.shape[2], k.type.shape[2]
    scale = scale if scale is not None else q.type.shape[-1] ** -0.5
    kt = ctx.add1("permute", [k], {"dims": [0, 1, 3, 2]})
    scores = ctx.add1("mul", [ctx.add1("matmul", [q, kt]), ctx.scalar(scale, q)])
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool).tril(source - length)
        keep = ctx.graph.add_constant("causal_mask", causal)
        scores = ctx.add1("where", [keep, scores, ctx.scalar(float("-inf"), scores)])
    if attn_mask is not None:
        mask = ctx.value(attn_mask)
        if mask.type.dtype == torch.bool:
            scores = ctx.add1("where", [mask, scores, ctx.scalar(float("-inf"), scores)])
        else:
            scores = ctx.add1("add", [scores, mask])
    return scale, scores


@lowers(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _flash_attention_backward(ctx, grad_out, query, key, value, out, logsumexp, dropout_p,
                              is_causal, *, attn_mask=None, scale=None):
    """The attention backward in math form, recomputing probabilities from the logsumexp:
    P = exp(S - lse); dV = P^T dO; dS = P * (dO V^T - rowsum(dO * O)); dQ = s dS K;
    dK = s dS^T Q."""
    q, k, v = ctx.value(query), ctx.value(key), ctx.value(value)
    d_out, o, lse = ctx.value(grad_out), ctx.value(out), ctx.value(logsumexp)
    scale, scores = _attention_scores(ctx, q, k, dropout_p, is_causal, attn_mask, scale)
    lse = reshape(ctx, lse, _shape(lse) + [1])
    probs = ctx.add1("exp", [ctx.add1("sub", [scores, lse])])
    t = {"dims": [0, 1, 3, 2]}
    grad_v = ctx.add1("matmul", [ctx.add1("permute", [probs], t), d_out])
    d_probs = ctx.add1("matmul", [d_out, ctx.add1("permute", [v], t)])
    row = ctx.add1("sum", [ctx.add1("mul", [d_out, o])], {"dims": [3], "keepdim": True})
    d_scores = ctx.add1("mul", [probs, ctx.add1("sub", [d_probs, row])])
    s = ctx.scalar(scale, q)
    grad_q = ctx.add1("mul", [ctx.add1("matmul", [d_scores, k]), s])
    grad_k = ctx.add1("mul", [ctx.add1("matmul", [ctx.add1("permute", [d_scores], t), q]), s])
    return [grad_q, grad_k, grad_v]


# -- pooling, dropout, indexing ------------------------------------------------------------------
def _uses_output(index: int, node) -> bool:
    return any(u.target is operator.getitem and u.args[1] == index for u in node.users)


def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    return list(v) * 2 if len(v) == 1 else list(v)


@lowers(aten.max_pool2d_with_indices.default)
def _max_pool2d(ctx, x, kernel, stride=None, padding=0, dilation=1, ceil_mode=False):
    kernel = _pair(kernel)
    with_indices = _uses_output(1, ctx.node)
    attrs = {"kernel": kernel, "stride": _pair(stride, kernel),
             "padding": _pair(padding if isinstance(padding, (list, tuple)) else [padding]),
             "dilation": _pair(dilation if isinstance(dilation, (list, tuple)) else [dilation]),
             "ceil_mode": ceil_mode, "with_indices": with_indices}
    outs = ctx.add("max_pool2d", [ctx.value(x)], attrs)
    return outs if with_indices else [outs[0], None]


@lowers(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(ctx, grad, x, kernel, stride, padding, dilation, ceil_mode, indices):
    kernel = _pair(kernel)
    return ctx.add1("max_pool2d_backward", [ctx.value(grad), ctx.value(x), ctx.value(indices)],
                    {"kernel": kernel, "stride": _pair(stride, kernel), "padding": _pair(padding),
                     "dilation": _pair(dilation), "ceil_mode": ceil_mode})


@lowers(aten.adaptive_max_pool2d.default)
def _adaptive_max_pool2d(ctx, x, output_size):
    with_indices = _uses_output(1, ctx.node)
    outs = ctx.add("adaptive_max_pool2d", [ctx.value(x)],
                   {"output_size": _pair(output_size), "with_indices": with_indices})
    return outs if with_indices else [outs[0], None]


@lowers(aten.adaptive_max_pool2d_backward.default)
def _adaptive_max_pool2d_backward(ctx, grad, x, indices):
    return ctx.add1("adaptive_max_pool2d_backward",
                    [ctx.value(grad), ctx.value(x), ctx.value(indices)])


@lowers(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    v = ctx.value(x)
    if train is False or p == 0:
        return [v, ctx.add1("full", [], {"shape": _shape(v), "value": True, "dtype": torch.bool})]
    return ctx.add("dropout", [v], {"p": p})


@lowers(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    w, idx = ctx.value(weight), ctx.value(indices)
    flat = reshape(ctx, idx, [idx.type.numel])
    rows = ctx.add1("index_select", [w, flat], {"dim": 0})
    return reshape(ctx, rows, _shape(idx) + [w.type.shape[1]])


@lowers(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    v = ctx.value(x)
    return ctx.add1("index_select", [v, ctx.value(index)], {"dim": dim % v.type.rank})


@lowers(aten.index.Tensor)
def _index(ctx, x, indices):
    """x[..., idx, ...] with one integer index tensor (any rank) at one dim, or with
    several at adjacent dims (see `_multi_index`)."""
    v = ctx.value(x)
    if sum(t is not None for t in indices) > 1:
        return _multi_index(ctx, v, indices)
    dim, index = _single_index(ctx, indices)
    flat = _wrapped(ctx, reshape(ctx, index, [index.type.numel]), v.type.shape[dim])
    picked = ctx.add1("index_select", [v, flat], {"dim": dim})
    shape = _shape(v)
    return reshape(ctx, picked, shape[:dim] + _shape(index) + shape[dim + 1:])


def _wrapped(ctx, index, size: int):
    """Negative indices count from the end, as `x[idx]` allows (index_select does not):
    where(idx < 0, idx + size, idx). Out-of-range ones still fail in index_select."""
    negative = ctx.add1("lt", [index, ctx.scalar(0, index)])
    shifted = ctx.add1("add", [index, ctx.scalar(size, index)])
    return ctx.add1("where", [negative, shifted, index])


def _multi_index(ctx, v, indices):
    """x[..., i, j, ...] with integer index tensors at adjacent dims (transformers' masks
    read `padding_mask[batch_idx, kv_idx]`): the indices broadcast together, wrap when
    negative, and combine into one row-major index into those dims flattened, which one
    index_select reads."""
    present = [d for d, t in enumerate(indices) if t is not None]
    first, count = present[0], len(present)
    if present != list(range(first, first + count)):
        raise Unsupported("advanced indexing with index tensors at dims that are not adjacent")
    shape = _shape(v)
    sizes = shape[first:first + count]
    values = [ctx.value(indices[d]) for d in present]
    if any(i.type.dtype not in (torch.int64, torch.int32) for i in values):
        raise Unsupported("advanced indexing other than by integer indices")
    broadcast = list(torch.broadcast_shapes(*(tuple(_shape(i)) for i in values)))
    linear = None
    for i, size, stride in zip(values, sizes, _row_strides(sizes)):
        if i.type.dtype != torch.int64:
            i = ctx.add1("cast", [i], {"dtype": torch.int64})
        i = _wrapped(ctx, i, size)
        if stride != 1:
            i = ctx.add1("mul", [i, ctx.scalar(stride, i)])
        linear = i if linear is None else ctx.add1("add", [linear, i])
    if _shape(linear) != broadcast:
        linear = ctx.add1("expand", [linear], {"shape": broadcast})
    numel = 1
    for d in broadcast:
        numel *= d
    rows = 1
    for d in sizes:
        rows *= d
    flat = reshape(ctx, v, shape[:first] + [rows] + shape[first + count:])
    picked = ctx.add1("index_select", [flat, reshape(ctx, linear, [numel])], {"dim": first})
    return reshape(ctx, picked, shape[:first] + broadcast + shape[first + count:])


def _row_strides(sizes):
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return strides[::-1]


def _single_index(ctx, indices):
    present = [(i, t) for i, t in enumerate(indices) if t is not None]
    if len(present) != 1:
        raise Unsupported("advanced indexing with more than one index tensor")
    dim, node = present[0]
    index = ctx.value(node)
    if index.type.dtype not in (torch.int64, torch.int32):
        raise Unsupported("advanced indexing other than by an integer index")
    return dim, index


@lowers(aten.index_put.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    """x[idx] = values (or +=) with one integer index tensor on dim 0: embedding backward."""
    dim, index = _single_index(ctx, indices)
    if dim != 0:
        raise Unsupported("index_put along a dim other than 0")
    v = ctx.value(x)
    count = index.type.numel
    rows = _shape(index) + _shape(v)[1:]
    vals = ctx.value(values)
    if _shape(vals) != rows:
        vals = ctx.add1("expand", [vals], {"shape": rows})
    vals = reshape(ctx, vals, [count] + _shape(v)[1:])
    flat = reshape(ctx, index, [count])
    if accumulate and _is_zeros(x) and vals.type.dtype == v.type.dtype:
        return ctx.add1("index_add_zeros", [flat, vals], {"rows": _shape(v)[0]})
    return ctx.add1("index_put", [v, flat, vals], {"accumulate": accumulate})


def _is_zeros(node) -> bool:
    """Whether an FX value is a fresh tensor of zeros (`full(shape, 0)`, `zeros`)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target in (aten.zeros.default, aten.new_zeros.default):
        return True
    return node.target is aten.full.default and node.args[1] == 0


@lowers(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    v = ctx.value(x)
    return ctx.add1("gather", [v, ctx.value(index)], {"dim": dim % v.type.rank})


@lowers(aten.scatter.value, aten.scatter.src)
def _scatter(ctx, x, dim, index, src):
    v, idx = ctx.value(x), ctx.value(index)
    if hasattr(src, "op"):
        s = ctx.value(src)
    else:
        s = ctx.add1("full", [], {"shape": _shape(idx), "value": src, "dtype": v.type.dtype})
    return ctx.add1("scatter", [v, idx, s], {"dim": dim % v.type.rank})
