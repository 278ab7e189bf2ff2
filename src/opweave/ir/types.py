"""Typed tensor values: a shape and an element type. A dimension is an int or, in a graph
compiled for many sizes, a symbolic expression (ir.symbols)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dtypes, symbols


@dataclass(frozen=True)
class TensorType:
    shape: tuple[symbols.Dim, ...]
    dtype: torch.dtype

    def __post_init__(self):
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                   or symbols.is_symbolic(d) for d in self.shape):
            raise ValueError(f"shape must be non-negative ints or symbols, got {self.shape}")
        dtypes.name_of(self.dtype)  # raises for dtypes the IR does not carry

    @property
    def is_static(self) -> bool:
        return symbols.is_static(self.shape)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> symbols.Dim:
        return symbols.product(self.shape)

    @property
    def nbytes(self) -> symbols.Dim:
        return self.numel * dtypes.itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{dtypes.name_of(self.dtype)}[{','.join(map(_dim_text, self.shape))}]"

    def substitute(self, binding) -> "TensorType":
        """This type with its symbols replaced by their values in `binding`."""
        if self.is_static:
            return self
        shape = symbols.substitute(self.shape, binding)
        if any(d < 0 for d in shape):
            raise symbols.SymbolError(f"{self} is {list(shape)} for {dict(binding)}: a size "
                                      f"cannot be negative")
        return TensorType(shape, self.dtype)

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorType":
        return TensorType(tuple(int(d) for d in tensor.shape), tensor.dtype)


def _dim_text(d) -> str:
    """A dimension as the text form writes it: `128`, `s0`, or `?"128*s0"`."""
    if isinstance(d, int) or d.is_Symbol:
        return str(d)
    return f'?"{d}"'
