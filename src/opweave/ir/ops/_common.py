"""Helpers shared by the op definitions: rule builders and the `define` shorthand."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .. import symbols
from ..registry import Attr, MappingType, OpDef, ShapeError, register
from ..types import TensorType


def define(name, num_inputs, mapping, shape, dtype, impl, *, attrs=None, flops=None, **extra) -> OpDef:
    """Register an op; `flops` defaults to zero (data movement only)."""
    return register(OpDef(
        name=name,
        num_inputs=num_inputs,
        attrs=attrs or {},
        shape_rule=shape,
        dtype_rule=dtype,
        mapping=mapping,
        flops=flops or (lambda ins, outs, a: 0),
        impl=impl,
        doc=(impl.__doc__ or "") if callable(impl) else "",
        **extra,
    ))


def meta(t: TensorType) -> torch.Tensor:
    """An empty tensor of `t`'s dtype and rank (for dtype rules; a symbolic dimension
    stands as 2: promotion depends on rank and dtype only)."""
    shape = t.shape if t.is_static else tuple(2 if symbols.is_symbolic(d) else d for d in t.shape)
    return torch.empty(shape, dtype=t.dtype, device="meta")


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    if not all(symbols.is_static(s) for s in shapes):
        try:
            return symbols.broadcast(*shapes)
        except symbols.SymbolError as err:
            raise ShapeError(str(err)) from None
    try:
        return tuple(torch.broadcast_shapes(*[tuple(s) for s in shapes]))
    except RuntimeError:
        raise ShapeError(f"shapes {', '.join(str(list(s)) for s in shapes)} do not broadcast") from None


def result_type(a: TensorType, b: TensorType) -> torch.dtype:
    """torch's type promotion, which depends on rank (0-d tensors promote like scalars)."""
    return torch.result_type(meta(a), meta(b))


def norm_dim(dim: int, rank: int) -> int:
    if not -max(rank, 1) <= dim < max(rank, 1):
        raise ShapeError(f"dim {dim} is out of range for rank {rank}")
    return dim % max(rank, 1)


def same_shape(ins, attrs):
    return [ins[0].shape]


def same_dtype(ins, attrs):
    return [ins[0].dtype]


def fixed_dtype(dtype: torch.dtype):
    return lambda ins, attrs: [dtype]


def per_output_element(k: float):
    """FLOPs of an op doing `k` operations per output element."""
    return lambda ins, outs, attrs: int(k * sum(o.numel for o in outs))


def per_input_element(k: float):
    return lambda ins, outs, attrs: int(k * ins[0].numel)


__all__ = ["Attr", "MappingType", "ShapeError", "TensorType", "define", "meta", "broadcast",
           "result_type", "norm_dim", "same_shape", "same_dtype", "fixed_dtype",
           "per_output_element", "per_input_element", "math", "torch"]


def with_dense_strides(x: torch.Tensor) -> torch.Tensor:
    """`x` viewed with the strides its dense layout (row-major or channels-last) gives a
    size-1 dim, where it is dense in one. A reshape of a permute of batch 1 (SegFormer's
    [1, HW, C] -> [1, C, H, W]) keeps a batch stride of C, and torch's kernels then miss
    their channels-last paths: upsampling [1, 256, 32, 32] to 128x128 took 17 ms against
    1 (Zen 4). (Applied to every reshape instead, it measured level on SegFormer, MobileViT
    and Swin: their other readers of such views are generated kernels and oneDNN, which
    take the strides as they are.)"""
    for layout in (torch.contiguous_format, torch.channels_last):
        if x.dim() == 4 or layout is torch.contiguous_format:
            if x.is_contiguous(memory_format=layout):
                dense = torch.empty(x.shape, device="meta", memory_format=layout).stride()
                return x if x.stride() == dense else x.as_strided(x.shape, dense)
    return x
