"""Shape arithmetic over symbolic sizes at ONNX import time.

A Shape of a tensor with symbolic dims is an int64 vector of dimensions (ints and sympy
expressions). The ops a model applies to such vectors before using them as a shape
(gather an entry, concatenate, slice, add or multiply, cast between integer types) are
computed here on numpy object arrays, one IR op at a time, with the op's own attributes.
Returns None for an op this cannot compute, so the caller can say so.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import sympy

from ..ir import dtypes

Fold = Callable[[list[np.ndarray], dict], np.ndarray]


def _truncating_divide(a, b):
    """Integer division as ONNX's (truncating). A size over symbols is positive, so by a
    positive divisor floor agrees; any other symbolic case is refused (ValueError)."""
    def divide(x, y):
        if isinstance(x, int) and isinstance(y, int):
            return abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1)
        if isinstance(y, int) and y > 0:
            return sympy.floor(sympy.sympify(x) / y)
        raise ValueError(f"cannot divide {x} by {y} over symbols")
    return np.vectorize(divide, otypes=[object])(a, b)


def _take(a: np.ndarray, index: np.ndarray, dim: int) -> np.ndarray:
    return np.take(a, index.astype(np.int64), axis=dim)


def _slice(a: np.ndarray, attrs: dict) -> np.ndarray:
    where = [slice(None)] * a.ndim
    where[attrs["dim"]] = slice(attrs["start"], attrs["end"], attrs["step"])
    return a[tuple(where)]


_FOLDS: dict[str, Fold] = {
    "reshape": lambda xs, a: xs[0].reshape([int(d) for d in a["shape"]]),
    "expand": lambda xs, a: np.broadcast_to(xs[0], [int(d) for d in a["shape"]]).copy(),
    "permute": lambda xs, a: np.transpose(xs[0], a["dims"]),
    "cat": lambda xs, a: np.concatenate(xs, axis=a["dim"]),
    "slice": lambda xs, a: _slice(xs[0], a),
    "index_select": lambda xs, a: _take(xs[0], xs[1], a["dim"]),
    "add": lambda xs, a: xs[0] + xs[1],
    "sub": lambda xs, a: xs[0] - xs[1],
    "mul": lambda xs, a: xs[0] * xs[1],
    "neg": lambda xs, a: -xs[0],
}


def fold_symbolic(op: str, arrays: list[np.ndarray], attrs: dict) -> np.ndarray | None:
    """`op` computed over object arrays of dimensions, or None where it cannot be."""
    if op == "cast":
        return arrays[0] if attrs["dtype"] in dtypes.INT_DTYPES else None
    if op == "div":
        if attrs.get("rounding") != "trunc":
            return None
        try:
            return _truncating_divide(*arrays)
        except (ValueError, ZeroDivisionError):
            return None
    fold = _FOLDS.get(op)
    if fold is None or any(not isinstance(a, np.ndarray) for a in arrays):
        return None
    try:
        return np.asarray(fold(arrays, attrs), dtype=object)
    except (ValueError, IndexError, TypeError):
        return None
