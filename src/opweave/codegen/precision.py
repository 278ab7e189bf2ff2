"""The precision policy: which steps compute in bfloat16, and how (`Options.precision`).

"fp32" (the default) computes everything in float32. "bf16": matrix products,
convolutions and attention read their operands rounded to bfloat16 and accumulate in
float32 (oneDNN's bf16 primitives; torch's bf16 flash-attention kernel, which keeps its
softmax in float32); the step's result, with its fused epilogue (bias, activation,
residual add), is rounded to bfloat16 once and widened back to float32. Every other op
(norms, softmax outside attention, reductions, pointwise kernels) computes in float32 as
before, and graph inputs and outputs stay float32. Constant weights and biases are
stored in bfloat16 at compile time. A group whose float32 form measures faster than its bf16 form
keeps float32 (only more accurate); `explain` counts the steps that run in bf16.

On a CPU without bf16 units (AVX2 only) oneDNN still computes bf16 correctly, converting
in software, and is then slower than float32; `units()` says which units this CPU has.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

LOWERED_OPS = frozenset({"matmul", "conv", "attention"})
LOW = torch.bfloat16


def narrow(t):
    """A float32 tensor rounded to bfloat16; anything else as it is."""
    return t.to(LOW) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def widen(t: torch.Tensor) -> torch.Tensor:
    """A bfloat16 result back in float32 (the graph's type); anything else as it is."""
    return t.float() if t.dtype == LOW else t


def lowered(fn: Callable) -> Callable:
    """`fn` (a step's function: tensors in, a list of tensors out) computed on bfloat16
    operands, its results widened back to float32."""
    def run(*args):
        return [widen(y) for y in fn(*[narrow(a) for a in args])]
    return run


def applies(precision: str, op: str) -> bool:
    """Whether a step computing `op` runs in bf16 under `precision`."""
    return precision == "bf16" and op in LOWERED_OPS


def units(cpuinfo: str | None = None) -> str:
    """The CPU's bf16 units (from `/proc/cpuinfo`'s flags, or the text given), as `explain`
    and the bench report them."""
    if cpuinfo is None:
        cpuinfo = _cpuinfo()
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[-1].split())
            break
    if "amx_bf16" in flags:
        return "AMX bf16 tiles"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16 dot products (no AMX)"
    return "no bf16 units: oneDNN converts in software, slower than float32"


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def tally(steps) -> tuple[int, int]:
    """(steps computing in bf16, steps computing a product, convolution or attention): what
    `explain` and the bench say of a compiled graph's precision."""
    eligible = [s for s in steps if any(n.op in LOWERED_OPS for n in s.nodes)]
    return sum(s.precision == "bf16" for s in eligible), len(eligible)
