"""Ops with no tensor inputs: graph constants, filled tensors and ranges."""
from __future__ import annotations

import sympy
import torch

from .. import symbols
from ._common import Attr, MappingType, ShapeError, define


def _constant(*, name, shape, dtype):
    """A named constant of the graph (weights, folded values); its data lives in `Graph.constants`."""
    raise RuntimeError(f"constant {name!r} has no data bound: the executor reads Graph.constants")


define("constant", 0, MappingType.ONE_TO_ONE, lambda ins, a: [tuple(a["shape"])],
       lambda ins, a: [a["dtype"]], _constant,
       attrs={"name": Attr("str"), "shape": Attr("ints"), "dtype": Attr("dtype")})


def _full(*, shape, value, dtype):
    """A tensor of `shape` filled with `value`."""
    return torch.full(shape, value, dtype=dtype)


define("full", 0, MappingType.ONE_TO_MANY, lambda ins, a: [tuple(a["shape"])],
       lambda ins, a: [a["dtype"]], _full,
       attrs={"shape": Attr("ints"), "value": Attr("scalar"), "dtype": Attr("dtype")},
       impl_out=lambda ins, a, out: out.fill_(a["value"]))


def _arange_shape(ins, attrs):
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    if step == 0:
        raise ShapeError("arange: step must not be zero")
    if not attrs["dtype"].is_floating_point and any(
            isinstance(v, float) and not v.is_integer() for v in (start, end, step)):
        # eager steps in floats and truncates; torch.export and Dynamo cast the bounds
        # and step to the dtype first (a step of 0.5 becomes 0): no two agree
        raise ShapeError(f"arange: fractional bounds or step ({start}, {end}, {step}) with "
                         f"integer dtype {attrs['dtype']}")
    if symbols.free_symbols((start, end, step)):  # a length known when the graph is called
        return [(sympy.ceiling((sympy.sympify(end) - start) / sympy.sympify(step)),)]
    return [(len(torch.arange(start, end, step, device="meta")),)]


def _arange(*, start, end, step, dtype):
    """start, start + step, ... up to (not including) end."""
    return torch.arange(start, end, step, dtype=dtype)


define("arange", 0, MappingType.ONE_TO_MANY, _arange_shape, lambda ins, a: [a["dtype"]], _arange,
       attrs={"start": Attr("scalar", 0), "end": Attr("scalar"), "step": Attr("scalar", 1),
              "dtype": Attr("dtype")})
