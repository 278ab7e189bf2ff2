"""Constant folding on a concrete graph: every node whose inputs are all constants becomes
the constant it computes.

The rewrite pass folds constants itself, but a graph of symbolic sizes is rewritten once
for every size (specializing.py), where a value computed from the sequence's length (a
slice of the position-id table, the embeddings it selects, an attention mask built from
`arange(s)`) is not a constant yet. Specialized, it is: this pass folds it, so each plan
runs what a static compile of its size would (BERT-base: 6 nodes fold, 16 go with the
views and slices only they read).
Views of constants (a weight stored transposed) stay views: folding them would copy.
Like the rewrite's fold rule, a result larger than its inputs (and than FOLD_SMALL
elements) stays computed: folding an `expand` would only cost memory.
"""
from __future__ import annotations

import torch

from ..ir import Graph, TensorType
from ..ir.graph import Node, Value
from .rewrite.rules.simplify import FOLD_SMALL


def fold_constants(graph: Graph) -> tuple[Graph, int]:
    """A copy of `graph` with every foldable node replaced by its value (the graph's own
    constants shared, not copied), and how many nodes were folded."""
    out = Graph(graph.name)
    out.symbols = list(graph.symbols)
    values: dict[Value, Value] = {v: out.add_input(v.name, v.type) for v in graph.inputs}
    data: dict[Value, torch.Tensor] = {}  # the new graph's constant values
    folded = 0
    for node in graph.nodes:
        ins = [values[v] for v in node.inputs]
        if node.op == "constant":
            tensor = graph.constants[node.attrs["name"]]
            new = out.add_constant(node.attrs["name"], tensor, source=node.source)
            values[node.outputs[0]] = new
            data[new] = tensor
            continue
        tensor = _value(node, ins, data)
        if tensor is not None and not node.opdef.is_view:
            new = out.add_constant(node.outputs[0].name, tensor, source=node.source)
            values[node.outputs[0]] = new
            data[new] = tensor
            folded += 1
            continue
        news = out.add(node.op, ins, node.attrs, source=node.source,
                       name=node.outputs[0].name if node.outputs else "")
        for old, new in zip(node.outputs, news):
            values[old] = new
        if tensor is not None:
            # a view of a constant stays a view (a contiguous copy of a transposed weight
            # would cost its bytes again in every plan), but what reads it may fold
            data[news[0]] = tensor
    out.outputs = [values[v] for v in graph.outputs]
    out.remove_dead()
    return out, folded


def _value(node: Node, ins: list[Value], data: dict[Value, torch.Tensor]) -> torch.Tensor | None:
    """The node's value if it can be folded: one output, not random, every input constant,
    a result no larger than its inputs (or FOLD_SMALL), of the type the graph declares."""
    if len(node.outputs) != 1 or node.opdef.is_random or not all(v in data for v in ins):
        return None
    out = node.outputs[0].type
    if not out.is_static or out.numel > max(sum(data[v].numel() for v in ins), FOLD_SMALL):
        return None
    with torch.no_grad():
        tensor = node.opdef.impl(*[data[v] for v in ins], **node.attrs)
    if not isinstance(tensor, torch.Tensor) or TensorType.of(tensor) != out:
        return None
    return tensor
