"""Specializing a symbolic graph: every symbol replaced by the value one call gives it.

A graph with symbolic dimensions (ir.symbols) is captured, lowered and verified once;
each distinct binding of its symbols becomes a concrete graph here, which the pipeline
then compiles like any other. The concrete graph is rebuilt node by node, so every op's
rule runs again on real sizes: a node whose concrete type differs from its symbolic type
with the values put in (a rule that decided a comparison of symbols one way, when these
values go the other) raises SymbolError instead of running a wrong plan.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from . import symbols
from .graph import Graph, Value
from .symbols import SymbolError


def graph_symbols(graph: Graph) -> set[str]:
    """The names of the symbols a call must give values: those in the inputs' shapes,
    and those the caller binds (`Graph.symbols`)."""
    return symbols.free_symbols(d for v in graph.inputs for d in v.type.shape) | set(graph.symbols)


def is_symbolic(graph: Graph) -> bool:
    return any(not v.type.is_static for v in graph.inputs)


def binding_of(graph: Graph, shapes: Sequence[Sequence[int]],
               given: Mapping[str, int] | None = None) -> dict[str, int]:
    """The symbol values that make `graph`'s inputs take `shapes` (with `given` for the
    symbols the caller binds); a SymbolError names an input whose rank or size
    contradicts the graph."""
    if len(shapes) != len(graph.inputs):
        raise SymbolError(f"graph {graph.name} takes {len(graph.inputs)} inputs, got {len(shapes)}")
    pairs = []
    for value, shape in zip(graph.inputs, shapes):
        if len(shape) != value.type.rank:
            raise SymbolError(f"input %{value.name} has rank {len(shape)}, the graph was "
                              f"compiled for {value.type}")
        pairs += [(d, int(s), f"input %{value.name} dim {axis}")
                  for axis, (d, s) in enumerate(zip(value.type.shape, shape))]
    pairs += [(symbols.symbol(name), int(size), f"symbol {name}")
              for name, size in (given or {}).items()]
    return symbols.bind(pairs)


def specialize(graph: Graph, binding: Mapping[str, int]) -> Graph:
    """A concrete copy of `graph` for `binding` (constants shared, not copied)."""
    binding = dict(binding)
    missing = graph_symbols(graph) - set(binding)
    if missing:
        raise SymbolError(f"graph {graph.name}: no value for {', '.join(sorted(missing))}")
    out = Graph(graph.name)
    out.constants = dict(graph.constants)
    values: dict[Value, Value] = {}
    for v in graph.inputs:
        values[v] = out.add_input(v.name, v.type.substitute(binding))
    for node in graph.nodes:
        attrs = {k: symbols.substitute(a, binding) for k, a in node.attrs.items()}
        try:
            new = out.add(node.op, [values[v] for v in node.inputs], attrs, source=node.source,
                          name=node.outputs[0].name if node.outputs else "")
        except (ValueError, TypeError) as err:
            raise SymbolError(f"graph {graph.name}, node {node!r} with {binding}: {err}") from None
        for old, value in zip(node.outputs, new):
            want = old.type.substitute(binding)
            if value.type != want:
                raise SymbolError(f"graph {graph.name}, node {node!r}: {value.type} for "
                                  f"{binding}, but {old.type} was compiled, which gives {want}")
            values[old] = value
    out.outputs = [values[v] for v in graph.outputs]
    return out
