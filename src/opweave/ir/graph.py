"""The tensor graph: Values (typed edges), Nodes (op applications) and the Graph itself.

A Graph is a list of nodes in topological order. Every value is either a graph input or
an output of exactly one node; weights enter through `constant` nodes whose data lives in
`Graph.constants`. Passes build new graphs or edit this one through the methods below.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from . import registry
from .types import TensorType

_NAME_OK = re.compile(r"[^A-Za-z0-9_.]")


@dataclass(eq=False)
class Value:
    name: str
    type: TensorType
    producer: "Node | None" = None  # None for graph inputs

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    attrs: dict
    outputs: list[Value] = field(default_factory=list)
    source: str = ""  # where the node came from: ir.provenance writes and reads it

    @property
    def opdef(self) -> registry.OpDef:
        return registry.get(self.op)

    def __repr__(self) -> str:
        outs = ", ".join(v.name for v in self.outputs)
        ins = ", ".join(v.name for v in self.inputs)
        return f"<{outs} = {self.op}({ins})>"


class Graph:
    def __init__(self, name: str = "main"):
        self.name = _NAME_OK.sub("_", name) or "main"
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.constants: dict[str, torch.Tensor] = {}
        # symbols (ir.symbols) a caller binds besides those in the inputs' shapes: a size
        # Dynamo passes as an int argument, say
        self.symbols: list[str] = []
        self._names: set[str] = set()

    # -- building -----------------------------------------------------------------------
    def fresh_name(self, hint: str = "v") -> str:
        base = _NAME_OK.sub("_", hint) or "v"
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def rename(self, value: Value, name: str) -> None:
        """Give `value` an exact name (the parsers restore names this way)."""
        if name != value.name and name in self._names:
            raise ValueError(f"value %{name} is defined twice")
        self._names.discard(value.name)
        value.name = name
        self._names.add(name)

    def add_input(self, name: str, type: TensorType) -> Value:
        value = Value(self.fresh_name(name), type)
        self.inputs.append(value)
        return value

    def add(self, op: str, inputs: Iterable[Value] = (), attrs: dict | None = None, *,
            name: str = "", source: str = "", types: list[TensorType] | None = None) -> list[Value]:
        """Append a node; its output types come from the op's rules unless `types` is given
        (the parser passes declared types so the verifier can check them)."""
        opdef = registry.get(op)
        inputs = list(inputs)
        full = opdef.full_attrs(attrs or {})
        if types is None:
            types = opdef.infer([v.type for v in inputs], full)
        node = Node(op, inputs, full, source=source)
        hint = name or op
        node.outputs = [Value(self.fresh_name(hint if len(types) == 1 else f"{hint}_{i}"), t, node)
                        for i, t in enumerate(types)]
        self.nodes.append(node)
        return node.outputs

    def add1(self, op: str, inputs: Iterable[Value] = (), attrs: dict | None = None, **kw) -> Value:
        (out,) = self.add(op, inputs, attrs, **kw)
        return out

    def add_constant(self, name: str, tensor: torch.Tensor, *, source: str = "") -> Value:
        """A constant node over `tensor` (stored, not copied; contiguous for the kernels)."""
        key = name
        i = 0
        while key in self.constants:
            i += 1
            key = f"{name}_{i}"
        self.constants[key] = tensor.detach().contiguous()
        t = TensorType.of(tensor)
        return self.add1("constant", [], {"name": key, "shape": list(t.shape), "dtype": t.dtype},
                         name=name, source=source)

    # -- queries --------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        """value -> the nodes reading it, in graph order (a node once per operand that
        is the value); a value nothing reads has no entry."""
        users: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                users.setdefault(v, []).append(node)
        return users

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def cost(self) -> registry.Cost:
        total = registry.Cost(0, 0)
        for node in self.nodes:
            if node.op != "constant":
                total = total + node.opdef.cost([v.type for v in node.inputs],
                                                [v.type for v in node.outputs], node.attrs)
        return total

    # -- editing --------------------------------------------------------------------------
    def remove_dead(self) -> int:
        """Drop nodes whose outputs nobody uses (random ops too: their values are unused),
        and constants no node reads. Returns how many nodes went."""
        live = set(self.outputs)
        kept = []
        for node in reversed(self.nodes):
            if any(v in live for v in node.outputs):
                kept.append(node)
                live.update(node.inputs)
        removed = len(self.nodes) - len(kept)
        self.nodes = kept[::-1]
        used = {n.attrs["name"] for n in self.nodes if n.op == "constant"}
        self.constants = {k: v for k, v in self.constants.items() if k in used}
        return removed

    def replace_uses(self, replaced: dict) -> None:
        """Point every reader of a value in `replaced` (and the graph's outputs) at its
        replacement, appended by a pass; then restore the order and drop what is dead."""
        for node in self.nodes:
            node.inputs = [replaced.get(v, v) for v in node.inputs]
        self.outputs = [replaced.get(v, v) for v in self.outputs]
        self.reorder()
        self.remove_dead()

    def reorder(self) -> None:
        """Restore topological order after a pass appended nodes that earlier nodes now
        read (keeping the given order where it already is one)."""
        placed, order = set(self.inputs), []
        pending = list(self.nodes)
        while pending:
            rest = []
            for node in pending:
                if all(v in placed for v in node.inputs):
                    order.append(node)
                    placed.update(node.outputs)
                else:
                    rest.append(node)
            if len(rest) == len(pending):
                raise AssertionError(f"graph {self.name} has a cycle")
            pending = rest
        self.nodes = order

    def __str__(self) -> str:
        from .text import print_graph

        return print_graph(self)
