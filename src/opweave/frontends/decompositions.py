"""The decomposition table used when capturing ATen graphs (export and AOTAutograd).

PyTorch's core-ATen decompositions keep the op set small, with one exception removed:
the core table decomposes the fused CPU flash-attention kernel into a form whose second
output is the attention matrix, not the logsumexp the fused backward expects, so under
AOTAutograd the gradients come out wrong (3.2 max abs error on a small ViT; PyTorch's
comment says inductor must exclude it too). opweave keeps the fused op and lowers it
itself (see `aten`), with the correct logsumexp.

The other composites (layer norm, softmax, log-softmax, GELU, NLL and their backwards)
are decomposed where that lets the partitioner fuse the parts: the backwards become
pointwise ops and sums along the last axis, which generated kernels fuse.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch._C import DispatchKey

aten = torch.ops.aten


@functools.lru_cache(maxsize=1)
def decomposition_table() -> dict:
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # Training-mode batch norm stays whole both ways (IR ops batch_norm_train and
    # batch_norm_backward): its statistics reduce over all axes but the channel, which
    # no generated kernel fuses, so the primitives would only add passes over memory.
    table.pop(aten.native_batch_norm_backward.default, None)
    for op in KEPT_WHOLE:  # (see ops_kept_whole)
        table.pop(op, None)
    return table


# Ops kept whole: out of the table, and, since torch decomposes them whenever it traces
# through autograd whatever the table says, without their Python kernels on the Autograd
# (and CompositeImplicitAutograd) keys while opweave traces. Decomposed, upsampling is
# index reads, and its backward scatter-adds (index_put with a row and a column index). The IR takes them whole (torch's kernels, channels-last): SegFormer's
# segmentation head spent about 280 ms of a 970 ms training step in the decomposed forms,
# where eager's kernels take 85.
KEPT_WHOLE = (aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default,
              aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default)
_TRACING_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)


@contextmanager
def ops_kept_whole():
    """While tracing (AOTAutograd, make_fx): the `KEPT_WHOLE` ops without their Python
    decompositions, so the graph holds them and their backwards as torch's own ops."""
    saved = []
    for op in KEPT_WHOLE:
        for key in _TRACING_KEYS:
            kernel = op.py_kernels.pop(key, None)
            if kernel is not None:
                saved.append((op, key, kernel))
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, kernel in saved:
            op.py_kernels[key] = kernel
        for op in KEPT_WHOLE:
            op._dispatch_cache.clear()
