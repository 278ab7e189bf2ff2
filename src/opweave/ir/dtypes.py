"""The element types of the IR and their mapping to torch dtypes."""
from __future__ import annotations

import torch

# short IR name -> torch dtype; the short names appear in the text form (f32[2,3]).
_BY_NAME: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "b8": torch.bool,
}
_BY_TORCH = {v: k for k, v in _BY_NAME.items()}

DTYPE_NAMES = tuple(_BY_NAME)
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def to_torch(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def name_of(dtype: torch.dtype) -> str:
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported by the opweave IR") from None


def is_supported(dtype: torch.dtype) -> bool:
    return dtype in _BY_TORCH


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
