"""Elementwise ops, casts, identities and creation (full, arange, ...)."""
from __future__ import annotations

import operator

import torch

from ...ir import symbols
from ..lowering import Unsupported, lowers
from .common import _shape, aten

# -- identity-like ---------------------------------------------------------------------------
@lowers(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
        aten.contiguous.default)
def _identity(ctx, x, *args, **kwargs):
    return ctx.value(x)


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
    aten.logical_not.default: "logical_not", aten.sign.default: "sign",
    aten.ceil.default: "ceil", aten.floor.default: "floor",
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


@lowers(aten.fmod.Scalar, aten.fmod.Tensor)
def _fmod(ctx, a, b):
    """C's remainder (the sign of the dividend) of integers: a - trunc(a / b) * b, with a
    signed divisor of -1 taken as 1 (the remainder is 0 either way, and INT_MIN / -1 traps
    the CPU). torch.roll's decomposition computes its indices this way (Swin's shifted
    windows). Floating-point fmod stays in eager: that formula would round where fmod
    does not."""
    va, vb = _operands(ctx, a, b)
    if va.type.dtype.is_floating_point or vb.type.dtype.is_floating_point:
        raise Unsupported("fmod of floating-point values")
    signed = vb.type.dtype.is_signed
    if signed and hasattr(b, "op"):
        minus_one = ctx.add1("eq", [vb, ctx.scalar(-1, vb)])
        vb = ctx.add1("where", [minus_one, ctx.scalar(1, vb), vb])
    elif signed and b == -1:  # (unsigned, -1 is the largest value, as torch casts it)
        vb = ctx.scalar(1, va)
    quotient = ctx.add1("div", [va, vb], {"rounding": "trunc"})
    return ctx.add1("sub", [va, ctx.add1("mul", [quotient, vb])])


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
        dtype = torch.int64 if all(isinstance(a, int) or symbols.is_symbolic(a)
                                   for a in (start, end, step)) \
            else torch.get_default_dtype()
    return ctx.add1("arange", [], {"start": start, "end": end, "step": step, "dtype": dtype})
