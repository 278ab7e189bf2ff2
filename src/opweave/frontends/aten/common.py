"""What the ATen lowering rules share: the `aten` namespace and small shape helpers."""
from __future__ import annotations

import operator

import torch

aten = torch.ops.aten
MAX_INDEX = 2**63 - 1


def _shape(v):
    return list(v.type.shape)


def _dims(dims, rank):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % max(rank, 1) for d in dims}) if rank else []

def _pair(v, default=None):
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    return list(v) * 2 if len(v) == 1 else list(v)


def reads_output(node, index: int) -> bool:
    """Whether anything reads output `index` of a node returning a tuple."""
    return any(user.target is not operator.getitem or user.args[1] == index
               for user in node.users)
