"""A graph's shape without its weights: what a report draws of a graph that is gone
(the input of the rewrite pass), for a few kilobytes where the graph would keep every
tensor it was built with alive."""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Graph


@dataclass(frozen=True)
class OutlineNode:
    name: str                # the (first) output value's name
    op: str                  # "input" for a graph input
    inputs: tuple[str, ...]  # producers' names; constants are left out
    type: str
    source: str = ""


def outline(graph: Graph) -> list[OutlineNode]:
    """Graph inputs, then every node but constants, in graph order."""
    rows = [OutlineNode(v.name, "input", (), str(v.type)) for v in graph.inputs]
    for node in graph.nodes:
        if node.op == "constant":
            continue
        ins = tuple(v.producer.outputs[0].name if v.producer is not None else v.name
                    for v in node.inputs
                    if v.producer is None or v.producer.op != "constant")
        rows.append(OutlineNode(node.outputs[0].name, node.op, ins, str(node.outputs[0].type),
                                node.source))
    return rows
