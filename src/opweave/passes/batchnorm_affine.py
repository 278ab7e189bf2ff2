"""Inference batch norm that no convolution absorbed, as a per-channel scale and shift.

The rewrite folds a batch norm into the convolution before it. One that reads anything
else (DenseNet's pre-activation norms read a concatenation: 62 of its 121) stays, and
`batch_norm` is a torch op no generated kernel takes, so it ran alone and the ReLU after
it ran alone too: two passes over the activation where one does (DenseNet-121 in bf16,
2-core Zen 4: 0.16 + 0.14 ms for the largest pair). As `x * scale + shift`, with scale and
shift folded per channel, it is elementwise, and the partitioner fuses it with the ReLU
and whatever else is elementwise around it. The rewrite's cost model would not choose
this form (it costs each op's pass over memory apart, not what fuses), so it is a pass
after extraction. torch computes inference batch norm as the same scale and shift.
"""
from __future__ import annotations

import torch

from ..ir import Graph
from ..partition.classify import constant_of


def batch_norm_as_affine(graph: Graph) -> int:
    """Rewrite, in place, each float32 `batch_norm` whose statistics and parameters are
    constants into `add(mul(x, scale), shift)`; returns how many changed. (torch computes
    a bf16 or fp16 batch norm in float32 and rounds once; as two ops of that type, the
    product and the shift are each rounded before they nearly cancel.)"""
    replaced: dict = {}
    changed = 0
    for node in list(graph.nodes):
        if node.op != "batch_norm":
            continue
        stats = [constant_of(graph, v) for v in node.inputs[1:]]
        x = node.inputs[0]
        if any(s is None for s in stats) or x.type.rank < 2 or x.type.dtype != torch.float32:
            continue  # (in bf16 or fp16 the product and the shift would each be rounded)
        weight, bias, mean, var = (s.double() for s in stats)
        scale = weight / torch.sqrt(var + node.attrs["eps"])
        shift = bias - mean * scale
        shape = [-1] + [1] * (x.type.rank - 2)
        name = node.outputs[0].name
        scaled = graph.add1("mul", [x, graph.add_constant(
            f"{name}_scale", scale.float().reshape(shape), source=node.source)],
            source=node.source)
        replaced[node.outputs[0]] = graph.add1("add", [scaled, graph.add_constant(
            f"{name}_shift", shift.float().reshape(shape), source=node.source)],
            source=node.source)
        changed += 1
    if changed:
        graph.replace_uses(replaced)
    return changed

