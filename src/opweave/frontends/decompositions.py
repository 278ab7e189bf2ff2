"""The decomposition table used when capturing ATen graphs (export and AOTAutograd).

PyTorch's core-ATen decompositions keep the op set small, with one exception removed:
the core table decomposes the fused CPU flash-attention kernel into a form whose second
output is the attention matrix, not the logsumexp the fused backward expects, so under
AOTAutograd the gradients come out wrong (3.2 max abs error on a small ViT; PyTorch's
comment says inductor must exclude it too). opweave keeps the fused op and lowers it
itself (see `aten_table`), with the correct logsumexp.
"""
from __future__ import annotations

import functools

import torch

aten = torch.ops.aten


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    from torch._decomp import core_aten_decompositions

    from torch._decomp import get_decompositions

    table = dict(core_aten_decompositions())
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # Training-mode batch norm: batch statistics and running-stat updates as primitives
    # (mean, var, mul, add), which the partitioner fuses with their neighbours.
    table.update(get_decompositions([aten._native_batch_norm_legit_functional.default]))
    return table
