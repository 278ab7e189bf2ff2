"""Padding as the IR spells it, shared by the ATen and ONNX frontends.

The IR has no pad op. Constant padding is a `cat` of the operand between `full` blocks,
the form the rewrite folds into a following convolution's own padding
(`zero-pad-into-conv`) and the lowering runs as `torch.constant_pad_nd`
(`lower.zero_pad_step`); a negative count crops with a `slice`. Reflect, edge and wrap
padding are an `index_select` of the source positions along each padded dim.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import symbols
from .graph import Value

# add1(op, inputs, attrs) -> Value: a frontend's way to add one IR node
Add1 = Callable[[str, list, dict], Value]
# constant(tensor) -> Value: its way to add a constant
Constant = Callable[[torch.Tensor], Value]

MODES = ("constant", "reflect", "edge", "wrap")


def pad(add1: Add1, v: Value, counts: dict[int, tuple[int, int]], mode: str = "constant",
        value=0, constant: Constant | None = None) -> Value:
    """`v` padded by `counts[dim] = (before, after)` in `mode` ("constant" with `value`;
    "reflect", "edge" or "wrap", which need `constant` for their positions); a negative
    count crops that side. Raises ValueError for a padding the mode cannot make."""
    if mode not in MODES:
        raise ValueError(f"padding mode {mode!r} (one of {', '.join(MODES)})")
    for dim, (before, after) in sorted(counts.items(), reverse=True):  # the last dim innermost
        if before < 0 or after < 0:
            size = v.type.shape[dim]
            v = add1("slice", [v], {"dim": dim, "start": max(-before, 0),
                                    "end": size - max(-after, 0), "step": 1})
            before, after = max(before, 0), max(after, 0)
        if not before and not after:
            continue
        if mode == "constant":
            v = _constant_blocks(add1, v, dim, before, after, value)
        else:
            v = _index_pad(add1, constant, v, dim, before, after, mode)
    return v


def _constant_blocks(add1: Add1, v: Value, dim: int, before: int, after: int, value) -> Value:
    pieces = []
    for count in (before, after):
        shape = list(v.type.shape)
        shape[dim] = count
        pieces.append(add1("full", [], {"shape": shape, "value": value, "dtype": v.type.dtype})
                      if count else None)
    return add1("cat", [p for p in (pieces[0], v, pieces[1]) if p is not None], {"dim": dim})


def source_positions(size: int, before: int, after: int, mode: str) -> list[int]:
    """For each position of a dim of `size` padded by `before` and `after` in `mode`, the
    position of the input it copies."""
    if mode == "reflect" and (before >= size or after >= size):
        raise ValueError(f"reflect padding of {before} and {after} needs a dim longer than "
                         f"both, got {size}")
    if mode == "wrap" and (before > size or after > size):
        raise ValueError(f"wrap padding of {before} and {after} is more than the dim's "
                         f"size {size}")
    positions = []
    for i in range(-before, size + after):
        if mode == "edge":
            positions.append(min(max(i, 0), size - 1))
        elif mode == "wrap":
            positions.append(i % size)
        else:  # reflect: mirrored about the first and last element, which are not repeated
            positions.append(-i if i < 0 else (2 * (size - 1) - i if i >= size else i))
    return positions


def _index_pad(add1: Add1, constant: Constant, v: Value, dim: int, before: int, after: int,
               mode: str) -> Value:
    size = v.type.shape[dim]
    if symbols.is_symbolic(size):
        raise ValueError(f"{mode} padding of a dim whose size ({size}) is known only per call")
    if size == 0:
        raise ValueError(f"{mode} padding of an empty dim")
    positions = torch.tensor(source_positions(size, before, after, mode), dtype=torch.int64)
    return add1("index_select", [v, constant(positions)], {"dim": dim})
