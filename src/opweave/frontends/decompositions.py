"""The decomposition table used when capturing ATen graphs (export and AOTAutograd).

PyTorch's core-ATen decompositions keep the op set small; opweave keeps a few composites
(softmax, layer norm) that the table would leave alone anyway.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    from torch._decomp import core_aten_decompositions

    return dict(core_aten_decompositions())
