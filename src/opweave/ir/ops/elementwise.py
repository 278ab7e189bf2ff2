"""Elementwise ops (one-to-one): unary, binary with broadcasting, `where`, and casts."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import (Attr, MappingType, ShapeError, broadcast, define, fixed_dtype, meta,
                      per_output_element, result_type, same_shape)

ONE = MappingType.ONE_TO_ONE


def _float_result(ins, attrs):
    dtype = ins[0].dtype
    return [dtype if dtype.is_floating_point else torch.get_default_dtype()]


def _out1(fn):
    """An `impl_out` for an elementwise torch function taking `out=`."""
    return lambda inputs, attrs, out: fn(*inputs, **attrs, out=out)


# name -> (torch function, flops per element, promotes ints to float)
_UNARY = {
    "neg": (torch.neg, 1, False),
    "abs": (torch.abs, 1, False),
    "exp": (torch.exp, 4, True),
    "log": (torch.log, 4, True),
    "log1p": (torch.log1p, 4, True),
    "sqrt": (torch.sqrt, 2, True),
    "rsqrt": (torch.rsqrt, 2, True),
    "reciprocal": (torch.reciprocal, 1, True),
    "sigmoid": (torch.sigmoid, 4, True),
    "tanh": (torch.tanh, 4, True),
    "erf": (torch.erf, 6, True),
    "relu": (torch.relu, 1, False),
    "sin": (torch.sin, 4, True),
    "cos": (torch.cos, 4, True),
    "sign": (torch.sign, 1, False),
    "ceil": (torch.ceil, 1, False),
    "floor": (torch.floor, 1, False),
}
for _name, (_fn, _k, _to_float) in _UNARY.items():
    define(_name, 1, ONE, same_shape, _float_result if _to_float else (lambda ins, a: [ins[0].dtype]),
           _fn, flops=per_output_element(_k),
           impl_out=None if _name == "relu" else _out1(_fn))

define("logical_not", 1, ONE, same_shape, fixed_dtype(torch.bool), torch.logical_not,
       flops=per_output_element(1), impl_out=_out1(torch.logical_not))


def _gelu(x, approximate):
    """GELU, exact (erf) or with the tanh approximation."""
    return F.gelu(x, approximate=approximate)


define("gelu", 1, ONE, same_shape, lambda ins, a: [ins[0].dtype], _gelu,
       attrs={"approximate": Attr("str", "none")}, flops=per_output_element(10))


def _clamp(x, min, max):
    """Clamp into [min, max]; a bound of None is open."""
    return torch.clamp(x, min, max)


def _clamp_dtype(ins, attrs):
    if attrs["min"] is None and attrs["max"] is None:
        raise ShapeError("clamp needs a min or a max")
    return [torch.clamp(meta(ins[0]), attrs["min"], attrs["max"]).dtype]


define("clamp", 1, ONE, same_shape, _clamp_dtype, _clamp,
       attrs={"min": Attr("optional_float", None), "max": Attr("optional_float", None)},
       flops=per_output_element(2))


def _cast(x, dtype):
    """Convert to another element type (always a new tensor)."""
    return x.to(dtype, copy=True)


define("cast", 1, ONE, same_shape, lambda ins, a: [a["dtype"]], _cast,
       attrs={"dtype": Attr("dtype")}, flops=per_output_element(0))


def _broadcast_shape(ins, attrs):
    return [broadcast(*(t.shape for t in ins))]


def _arith_dtype(ins, attrs):
    return [result_type(*ins)]


def _div_dtype(ins, attrs):
    dtype = result_type(*ins)
    if attrs.get("rounding", "none") == "none" and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return [dtype]


def _div(a, b, rounding):
    """Division: true division, or rounded by 'floor' or 'trunc'."""
    return torch.div(a, b, rounding_mode=None if rounding == "none" else rounding)


_BINARY = {
    "add": (torch.add, _arith_dtype),
    "sub": (torch.sub, _arith_dtype),
    "mul": (torch.mul, _arith_dtype),
    "pow": (torch.pow, _arith_dtype),
    "maximum": (torch.maximum, _arith_dtype),
    "minimum": (torch.minimum, _arith_dtype),
    "eq": (torch.eq, fixed_dtype(torch.bool)),
    "ne": (torch.ne, fixed_dtype(torch.bool)),
    "lt": (torch.lt, fixed_dtype(torch.bool)),
    "le": (torch.le, fixed_dtype(torch.bool)),
    "gt": (torch.gt, fixed_dtype(torch.bool)),
    "ge": (torch.ge, fixed_dtype(torch.bool)),
    "logical_and": (torch.logical_and, fixed_dtype(torch.bool)),
    "logical_or": (torch.logical_or, fixed_dtype(torch.bool)),
}
for _name, (_fn, _dt) in _BINARY.items():
    define(_name, 2, ONE, _broadcast_shape, _dt, _fn, flops=per_output_element(1),
           impl_out=_out1(_fn))

define("div", 2, ONE, _broadcast_shape, _div_dtype, _div,
       attrs={"rounding": Attr("str", "none")}, flops=per_output_element(1))


def _where_dtype(ins, attrs):
    if ins[0].dtype != torch.bool:
        raise ShapeError(f"where: condition must be b8, got {ins[0]}")
    return [result_type(ins[1], ins[2])]


define("where", 3, ONE, _broadcast_shape, _where_dtype, torch.where, flops=per_output_element(1),
       impl_out=_out1(torch.where))
