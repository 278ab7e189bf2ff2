"""Which calls a program captured with `torch.export` dynamic dims (`Dim`) can run.

`opweave.compile(model, inputs, dynamic_shapes=...)` captures the model once with the
dims the user marked as symbols; the captured placeholders then say, per tensor and axis,
a fixed size or a symbol (or an expression over symbols), and torch.export's range
constraints bound each symbol. A call fits the program when its sizes give every symbol
one value inside its range; every other call gets a static program of its own (see
`torch_export.CompiledModel`). Sizes below 1 never fit: the IR's symbols are positive.
"""
from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from ..ir import symbols
from ..runtime.executor import InputError
from .binding import _text


class DynamicInputTypes:
    """The tensor types of a dynamic program's inputs, checked per call."""

    def __init__(self, placeholders: list[fx.Node], ranges: dict[str, tuple[int, float]]):
        self.kinds = []  # per tensor: (dims, dtype, device, layout); a dim is an int or sympy
        for node in placeholders:
            value = node.meta["val"]
            dims = tuple(symbols.dim(d) if isinstance(d, torch.SymInt) else int(d)
                         for d in value.shape)
            self.kinds.append((dims, value.dtype, value.device, value.layout))
        self.ranges = ranges
        self._fitting: set[tuple] = set()  # the tensor types of calls that fit, for speed

    @property
    def symbolic(self) -> bool:
        return any(symbols.is_symbolic(d) for dims, *_ in self.kinds for d in dims)

    def misfit(self, name: str, tensors: list[torch.Tensor]) -> str:
        """'' when the call fits; otherwise why its sizes do not. A dtype, device or
        layout other than the example's is an InputError: no program takes it."""
        seen = tuple((t.shape, t.dtype, t.device, t.layout) for t in tensors)
        if seen in self._fitting:
            return ""
        why = self._misfit(name, tensors)
        if not why:
            if len(self._fitting) >= 1024:
                self._fitting.clear()
            self._fitting.add(seen)
        return why

    def _misfit(self, name: str, tensors: list[torch.Tensor]) -> str:
        binding: dict[str, int] = {}
        where: dict[str, str] = {}  # a symbol -> the first axis that gave its value
        derived = []
        for i, ((dims, dtype, device, layout), t) in enumerate(zip(self.kinds, tensors)):
            if (t.dtype, t.device, t.layout) != (dtype, device, layout) or t.dim() != len(dims):
                shape = "[" + ", ".join(str(d) for d in dims) + "]"
                raise InputError(f"{name} was compiled for tensor argument {i} of shape "
                                 f"{shape}, {dtype} on {device} ({layout}), got "
                                 f"{_text((tuple(t.shape), t.dtype, t.device, t.layout))}")
            for axis, (want, got) in enumerate(zip(dims, t.shape)):
                if isinstance(want, int):
                    if want != got:
                        return f"tensor argument {i} has size {got} at axis {axis}, not {want}"
                elif isinstance(want, sympy.Symbol):
                    bound = binding.setdefault(want.name, got)
                    where.setdefault(want.name, f"axis {axis} of tensor argument {i}")
                    if bound != got:
                        return (f"axis {axis} of tensor argument {i} is {got}, but "
                                f"{where[want.name]}, the same dim, is {bound}")
                else:
                    derived.append((i, axis, want, got))
        for symbol, value in binding.items():
            low, high = self.ranges.get(symbol, (1, math.inf))
            if not max(low, 1) <= value <= high:
                high_text = "" if math.isinf(high) else f", at most {int(high)}"
                return (f"{where[symbol]} is {value}, outside the range compiled for it "
                        f"(at least {max(low, 1)}{high_text})")
        for i, axis, want, got in derived:
            if symbols.free_symbols([want]) - binding.keys():
                return f"axis {axis} of tensor argument {i} ({want}) has no symbol bound"
            if symbols.substitute(want, binding) != got:
                return f"axis {axis} of tensor argument {i} is {got}, not {want}"
        return ""


def export_ranges(exported: torch.export.ExportedProgram) -> dict[str, tuple[int, float]]:
    """Each symbol's (lowest, highest) value as torch.export proved it (highest inf when
    unbounded)."""
    return {str(sym): (int(vr.lower), float(vr.upper) if math.isinf(float(vr.upper))
                       else int(vr.upper))
            for sym, vr in exported.range_constraints.items()}
