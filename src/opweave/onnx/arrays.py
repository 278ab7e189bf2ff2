"""numpy <-> torch for ONNX values, including bfloat16 (numpy has none; onnx uses
ml_dtypes' bfloat16, which shares its bit layout)."""
from __future__ import annotations

import numpy as np
import torch

from .errors import OnnxError


def _is_bfloat16(array: np.ndarray) -> bool:
    return array.dtype.name == "bfloat16"


def to_tensor(array, what: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    array = np.asarray(array)
    if not array.flags.c_contiguous:
        array = array.copy()
    if _is_bfloat16(array):
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    try:
        return torch.from_numpy(array)
    except TypeError:
        raise OnnxError(f"{what} has numpy dtype {array.dtype}, which opweave does not support") from None


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
