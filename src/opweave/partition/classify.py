"""What each IR node can be in a fused kernel, from the registry's DNNFusion mapping types.

- ANCHOR: a contraction that runs on a library (oneDNN/MKL through torch) and can absorb an
  epilogue (bias, activation, residual add): a linear layer (`matmul` by a constant
  weight) or a 2-D convolution with constant weights.
- POINTWISE: a one-to-one op the C++ generator can emit in float32.
- ROW_REDUCE: a many-to-many op that reduces along the last axis and maps back onto it
  (softmax, log-softmax, layer norm): it fuses with one-to-one neighbours row by row.
- COLUMN_SUM: a sum over every axis but the last (a bias or layer-norm weight gradient):
  it fuses with the one-to-one ops that produce its input, as their last step.
- VIEW: a reorganize/shuffle op that moves no data; only a reshape may join an anchor's
  epilogue chain.
- OPAQUE: everything else runs as the library op it is.
Each role comes with the reason a node is not more fusible, for `OPWEAVE_DEBUG` reports.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..ir import Graph, MappingType
from ..ir.graph import Node
from ..ir.ops.reduction import column_sum_axes

# Reductions whose input, not output, is the loop a kernel runs (see iteration_shape).
_SUM_OPS = frozenset({"sum", "mean"})


@dataclass(frozen=True)
class Fusible:
    """What a code generator can put in a generated kernel; the generator declares it
    (codegen.render.FUSIBLE) and the partitioner asks, so the two never disagree."""

    pointwise: frozenset[str]    # one-to-one float32 ops with a formula
    compare: frozenset[str]      # float32 comparisons producing bool
    row_reduce: frozenset[str]   # reductions along the last axis mapped back onto it
    row_sum: frozenset[str]      # plain sums along the last axis (kept) or columns
    max_row: int                 # longest row a generated row reduction holds


class Role(enum.Enum):
    ANCHOR = "anchor"
    POINTWISE = "pointwise"
    ROW_REDUCE = "row-reduce"
    COLUMN_SUM = "column-sum"
    VIEW = "view"
    OPAQUE = "opaque"


def constant_of(graph: Graph, value) -> torch.Tensor | None:
    """The tensor behind `value` if it is a constant, seen through a transposing permute
    (the layout pass stores GEMM weights transposed and reads them through a view)."""
    node = value.producer
    if node is None:
        return None
    if node.op == "constant":
        return graph.constants[node.attrs["name"]]
    if node.op == "permute" and node.attrs["dims"] == [1, 0]:
        base = constant_of(graph, node.inputs[0])
        return None if base is None else base.t()
    return None


def linear_weight(graph: Graph, node: Node) -> torch.Tensor | None:
    """For `matmul(x[M,K], W[K,N])` with a constant W, that W; else None."""
    if node.op != "matmul" or len(node.inputs) != 2:
        return None
    x, w = node.inputs
    if x.type.rank != 2 or w.type.rank != 2:
        return None
    return constant_of(graph, w)


def classify(graph: Graph, node: Node, fusible: Fusible) -> tuple[Role, str]:
    """The node's role under what `fusible` can generate and, for anything less than
    fully fusible, why."""
    op = node.op
    if node.opdef.is_view:
        return Role.VIEW, "a view moves no data"
    floats = all(v.type.dtype == torch.float32 for v in node.outputs)
    if op in fusible.compare and all(v.type.dtype == torch.float32 for v in node.inputs):
        return Role.POINTWISE, ""
    if not floats:
        return Role.OPAQUE, f"{op} produces {node.outputs[0].type.dtype}, kernels are float32"
    if op == "matmul":
        if linear_weight(graph, node) is None:
            return Role.OPAQUE, "matmul of two activations (no constant weight to pack)"
        return Role.ANCHOR, ""
    if op == "conv":
        if node.inputs[0].type.rank not in (3, 4) or constant_of(graph, node.inputs[1]) is None:
            return Role.OPAQUE, "only 1-D and 2-D convolutions with constant weights are anchors"
        if len(node.inputs) > 2 and constant_of(graph, node.inputs[2]) is None:
            return Role.OPAQUE, "convolution bias is not constant"
        return Role.ANCHOR, ""
    if op in fusible.row_reduce:
        return _row_reduce_role(node, fusible.max_row)
    if op in fusible.row_sum:
        return _row_sum_role(node)
    if node.opdef.mapping is not MappingType.ONE_TO_ONE or node.opdef.is_random:
        return Role.OPAQUE, f"{op} is {node.opdef.mapping.value}"
    if op not in fusible.pointwise:
        return Role.OPAQUE, f"no generated formula for {op}"
    if op == "div" and node.attrs["rounding"] != "none":
        return Role.OPAQUE, "rounding division"
    for v in node.inputs:
        allowed = (torch.bool,) if op == "where" and v is node.inputs[0] else (torch.float32,)
        if v.type.dtype not in allowed:
            return Role.OPAQUE, f"{op} reads {v.type.dtype}"
    if op == "pow" and node.inputs[1].type.numel != 1:
        return Role.OPAQUE, "pow with a tensor exponent"
    return Role.POINTWISE, ""


def _row_reduce_role(node: Node, max_row: int) -> tuple[Role, str]:
    x = node.inputs[0]
    if any(v.type.dtype != torch.float32 for v in node.inputs):
        return Role.OPAQUE, "row reductions are generated for float32"
    if x.type.rank == 0 or x.type.shape[-1] > max_row:
        return Role.OPAQUE, f"rows longer than {max_row} elements stay in torch"
    if node.op == "layer_norm":
        if len(node.attrs["normalized_shape"]) != 1:
            return Role.OPAQUE, "layer norm over more than the last axis"
        return Role.ROW_REDUCE, ""
    if node.attrs["dim"] % max(x.type.rank, 1) != x.type.rank - 1:
        return Role.OPAQUE, f"{node.op} along a non-last axis"
    return Role.ROW_REDUCE, ""


def _row_sum_role(node: Node) -> tuple[Role, str]:
    x = node.inputs[0]
    if x.type.dtype != torch.float32 or x.type.rank == 0:
        return Role.OPAQUE, "sums are generated for float32 tensors"
    if is_column_sum(node):
        return Role.COLUMN_SUM, ""
    dims = {d % x.type.rank for d in node.attrs["dims"]} if node.attrs["dims"] else None
    if dims != {x.type.rank - 1} or not node.attrs["keepdim"]:
        return Role.OPAQUE, f"{node.op} over other axes than the last (kept), or all but it"
    return Role.ROW_REDUCE, ""


def is_column_sum(node: Node) -> bool:
    """A sum of each column: over every axis but the last (axes of size 1 aside)."""
    if node.op != "sum" or not node.attrs["dims"]:
        return False
    shape = node.inputs[0].type.shape
    return column_sum_axes(shape, {d % len(shape) for d in node.attrs["dims"]})


def iteration_shape(node: Node) -> tuple[int, ...]:
    """The shape a kernel containing `node` loops over: a sum loops over its input."""
    if node.op in _SUM_OPS:
        return tuple(node.inputs[0].type.shape)
    return tuple(node.outputs[0].type.shape)


def roles(graph: Graph, fusible: Fusible) -> dict[Node, tuple[Role, str]]:
    return {n: classify(graph, n, fusible) for n in graph.nodes if n.op != "constant"}
