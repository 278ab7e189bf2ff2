"""Typed tensor values: a static shape and an element type."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import dtypes


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        if not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise ValueError(f"shape must be non-negative ints, got {self.shape}")
        dtypes.name_of(self.dtype)  # raises for dtypes the IR does not carry

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{dtypes.name_of(self.dtype)}[{','.join(map(str, self.shape))}]"

    @staticmethod
    def of(tensor: torch.Tensor) -> "TensorType":
        return TensorType(tuple(int(d) for d in tensor.shape), tensor.dtype)
