"""Shrinking a failing graph: delta debugging over its nodes and outputs.

A node is removed by cutting it out: its outputs become new graph inputs that carry the
values eager computed for them, so everything downstream sees the same numbers and a
failure that depends on them survives. Nodes nobody needs any more go with it. Each
candidate is kept only if it still fails the same way.
"""
from __future__ import annotations

from typing import Callable

from ..ir import Graph, verify
from . import oracle


def cut(case: oracle.Case, remove: set, outputs: list | None = None) -> oracle.Case | None:
    """The case with the nodes in `remove` replaced by inputs (eager values), keeping the
    graph outputs in `outputs` (default: all those not removed). None if nothing is left."""
    graph = case.graph
    env = oracle.evaluate(graph, case.inputs)
    keep_outputs = [v for v in (outputs if outputs is not None else graph.outputs)
                    if v.producer not in remove]
    if not keep_outputs:
        return None
    new = Graph(graph.name)
    mapping, data = {}, {}
    for value, tensor in zip(graph.inputs, case.inputs):
        mapping[value] = new.add_input(value.name, value.type)
        data[mapping[value]] = tensor
    for node in graph.nodes:
        if node in remove:
            for value in node.outputs:
                mapping[value] = new.add_input(value.name, value.type)
                data[mapping[value]] = env[value].detach().contiguous().clone()
        elif node.op == "constant":
            name = node.attrs["name"]
            mapping[node.outputs[0]] = new.add_constant(name, graph.constants[name])
        else:
            outs = new.add(node.op, [mapping[v] for v in node.inputs], node.attrs,
                           name=node.outputs[0].name if len(node.outputs) == 1 else node.op)
            mapping.update(zip(node.outputs, outs))
    new.outputs = [mapping[v] for v in keep_outputs]
    new.remove_dead()
    live = {id(v) for n in new.nodes for v in n.inputs} | {id(v) for v in new.outputs}
    new.inputs = [v for v in new.inputs if id(v) in live]
    if not any(n.op != "constant" for n in new.nodes):
        return None
    return oracle.Case(verify(new), [data[v] for v in new.inputs])


def size(case: oracle.Case) -> int:
    return sum(1 for n in case.graph.nodes if n.op != "constant")


def minimize(case: oracle.Case, fails: Callable[[oracle.Case], bool], max_checks: int = 60) -> oracle.Case:
    """The smallest case found (greedily) on which `fails` still holds: the earliest value
    that fails alone becomes the only output (its consumers go), then nodes are cut one
    at a time, until no single step keeps the failure."""
    checks = 0

    def attempt(candidate) -> bool:
        nonlocal checks
        if candidate is None or checks >= max_checks:
            return False
        checks += 1
        try:
            return fails(candidate)
        except Exception:  # noqa: BLE001  (a candidate the oracle cannot run: not kept)
            return False

    changed = True
    while changed and checks < max_checks:
        changed = False
        # one value alone as the output, earliest first: drops every consumer after it
        values = [v for n in case.graph.nodes if n.op != "constant" for v in n.outputs]
        if len(values) > 1 or len(case.graph.outputs) > 1:
            for value in values:
                candidate = cut(case, set(), [value])
                if attempt(candidate):
                    case, changed = candidate, True
                    break
            else:  # the failure needs several outputs: drop the others one by one
                for value in list(case.graph.outputs):
                    candidate = cut(case, set(), [v for v in case.graph.outputs if v is not value])
                    if attempt(candidate):
                        case, changed = candidate, True
        # cut nodes, producers before consumers (a cut near the inputs frees the most)
        index = 0
        while index < len(case.graph.nodes) and checks < max_checks:
            node = case.graph.nodes[index]
            index += 1
            if node.op == "constant":
                continue
            candidate = cut(case, {node})
            if attempt(candidate):
                case, changed, index = candidate, True, 0
    return case
