"""Cheap encodings: an activation the backward reads only through a comparison with a
constant is kept as that comparison's mask (one byte per element) instead of itself.

The case is ReLU's: its backward is `where(le(relu_out, 0), 0, grad)`, so `relu_out`
(four bytes per element) stays alive from the forward to the backward for a one-bit
question. Moving the comparison up to just after the value is made, where every other
reader of the value comes first, lets the value be freed after its forward readers and
keeps only the mask. The move changes no result: the comparison reads the same value.

The rematerialization planner then weighs the mask like any other value: keep it (a
quarter of the bytes) or recompute it in the backward from a recomputed value.
"""
from __future__ import annotations

from ...ir import Graph, Node, Value

COMPARISONS = frozenset({"le", "lt", "ge", "gt", "eq", "ne"})


def hoist_masks(graph: Graph) -> list[Node]:
    """Move each comparison of a value with constants that is worth encoding (see the
    module's docstring) to just after the last of its operands is made, in place.
    Returns the comparisons moved."""
    readers = graph.users()
    moved = []
    for value, comparisons in _maskable(graph, readers):
        for comparison in comparisons:
            graph.nodes.remove(comparison)
            at = graph.nodes.index(value.producer) + 1
            for operand in comparison.inputs:  # its constants move up too, if made later
                constant = operand.producer
                if operand is not value and graph.nodes.index(constant) >= at:
                    graph.nodes.remove(constant)
                    graph.nodes.insert(at, constant)
                    at += 1
            graph.nodes.insert(at, comparison)
            moved.append(comparison)
    return moved


def _maskable(graph: Graph, readers: dict[Value, list[Node]]):
    """(value, its comparisons) where the comparisons are its last readers, each makes
    fewer bytes than the value, and moving them up would free the value earlier."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    outputs = set(graph.outputs)
    for node in graph.nodes:
        for value in node.outputs:
            if value in outputs or node.op == "constant":
                continue
            users = readers.get(value, [])
            comparisons = [u for u in users if _compares_with_constants(u, value)]
            others = [u for u in users if u not in comparisons]
            if not comparisons or any(c.outputs[0].type.nbytes >= value.type.nbytes
                                      for c in comparisons):
                continue
            first = min(position[c] for c in comparisons)
            last_other = max((position[u] for u in others), default=position[node])
            if last_other < first and first > position[node] + 1:
                yield value, comparisons


def _compares_with_constants(node: Node, value: Value) -> bool:
    return node.op in COMPARISONS and all(
        v is value or (v.producer is not None and v.producer.op == "constant")
        for v in node.inputs)
