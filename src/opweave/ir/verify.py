"""The verifier: checks a graph is well formed. Cheap enough to run after every pass."""
from __future__ import annotations

from . import registry, symbols
from .graph import Graph, Node
from .types import TensorType


class VerificationError(ValueError):
    """A malformed graph; the message names the node and the problem."""


def _where(index: int, node: Node) -> str:
    outs = ", ".join("%" + v.name for v in node.outputs) or "(no outputs)"
    return f"node {index} ({outs} = {node.op})"


def verify(graph: Graph) -> Graph:
    """Raise VerificationError on the first problem found; return the graph otherwise."""
    defined = {}
    for value in graph.inputs:
        if value.name in defined:
            raise VerificationError(f"graph input %{value.name} is defined twice")
        defined[value.name] = value
    positions = {id(v): i for i, node in enumerate(graph.nodes) for v in node.outputs}
    # every symbol must be a dimension of an input (a call's shapes give its value) or
    # one the caller binds (Graph.symbols)
    bound = symbols.free_symbols(d for v in graph.inputs for d in v.type.shape)
    bound |= set(graph.symbols)

    for index, node in enumerate(graph.nodes):
        where = _where(index, node)
        if not registry.has(node.op):
            raise VerificationError(f"{where}: unknown op {node.op!r}")
        opdef = registry.get(node.op)
        for value in node.inputs:
            if defined.get(value.name) is not value:
                later = positions.get(id(value))
                if later is not None and later >= index:
                    raise VerificationError(
                        f"{where}: input %{value.name} is produced by node {later}, which does "
                        f"not come before it (the graph is cyclic or out of topological order)"
                        + _cycle_hint(graph))
                raise VerificationError(f"{where}: input %{value.name} is not defined")
        if opdef.num_inputs is not None and len(node.inputs) != opdef.num_inputs:
            raise VerificationError(
                f"{where}: takes {opdef.num_inputs} inputs, got {len(node.inputs)}")
        _check_attrs(where, opdef, node)
        try:
            expected = opdef.infer([v.type for v in node.inputs], node.attrs)
        except (ValueError, TypeError, RuntimeError, IndexError) as err:
            raise VerificationError(f"{where}: {err}") from None
        declared = [v.type for v in node.outputs]
        stray = symbols.free_symbols([t.shape for t in declared] + list(node.attrs.values())) - bound
        if stray:
            raise VerificationError(f"{where}: symbol(s) {', '.join(sorted(stray))} appear in no "
                                    f"input's shape nor in the graph's symbols, so no call can give their values")
        if expected != declared:
            raise VerificationError(
                f"{where}: declared output types {_types(declared)} but the op's rules give "
                f"{_types(expected)}")
        if node.op == "constant":
            _check_constant(where, graph, node)
        for value in node.outputs:
            if value.name in defined:
                raise VerificationError(f"{where}: value %{value.name} is defined twice")
            if value.producer is not node:
                raise VerificationError(f"{where}: output %{value.name} does not point back to it")
            defined[value.name] = value

    for value in graph.outputs:
        if defined.get(value.name) is not value:
            raise VerificationError(f"graph output %{value.name} is not defined")
    return graph


def _types(types: list[TensorType]) -> str:
    return "(" + ", ".join(map(str, types)) + ")"


def _check_attrs(where: str, opdef: registry.OpDef, node: Node) -> None:
    missing = set(opdef.attrs) - set(node.attrs)
    unknown = set(node.attrs) - set(opdef.attrs)
    if missing or unknown:
        raise VerificationError(
            f"{where}: attributes missing {sorted(missing)} / unknown {sorted(unknown)}")
    for key, spec in opdef.attrs.items():
        if not spec.check(node.attrs[key]):
            raise VerificationError(
                f"{where}: attribute {key}={node.attrs[key]!r} is not of kind {spec.kind}")


def _check_constant(where: str, graph: Graph, node: Node) -> None:
    name = node.attrs["name"]
    data = graph.constants.get(name)
    if data is None:
        raise VerificationError(f"{where}: constant {name!r} has no data in the graph")
    if TensorType.of(data) != node.outputs[0].type:
        raise VerificationError(
            f"{where}: constant {name!r} holds {TensorType.of(data)}, declared {node.outputs[0].type}")


def _cycle_hint(graph: Graph) -> str:
    """Name a cycle if there is one (a plain misordering has none)."""
    producer = {id(v): node for node in graph.nodes for v in node.outputs}
    state: dict[int, int] = {}  # 1 = on the stack, 2 = done
    stack_path: list[Node] = []

    def visit(node: Node) -> list[Node] | None:
        state[id(node)] = 1
        stack_path.append(node)
        for value in node.inputs:
            dep = producer.get(id(value))
            if dep is None:
                continue
            if state.get(id(dep)) == 1:
                return stack_path[stack_path.index(dep):]
            if id(dep) not in state:
                found = visit(dep)
                if found:
                    return found
        stack_path.pop()
        state[id(node)] = 2
        return None

    for node in graph.nodes:
        if id(node) not in state:
            cycle = visit(node)
            if cycle:
                names = " -> ".join("%" + n.outputs[0].name for n in cycle if n.outputs)
                return f"; cycle: {names}"
    return ""
