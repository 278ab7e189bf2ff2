"""Graph facts the partitioner asks about repeatedly: roles, users, reachability."""
from __future__ import annotations

from ..ir import Graph
from ..ir.graph import Node, Value
from .classify import Fusible, Role, classify


class Context:
    """Per-graph tables. Reachability is kept as Python ints used as bitsets over node
    positions, so a group's convexity test is a few big-integer operations."""

    def __init__(self, graph: Graph, fusible: Fusible, anchor_seconds=None,
                 apart: frozenset[Node] = frozenset(), conversion_seconds=None,
                 float32_residuals: bool = False, fused_bytes=None):
        self.graph = graph
        self.fusible = fusible
        # a product's residual add is not its post-op (legality.anchor_epilogue)
        self.float32_residuals = float32_residuals
        self.anchor_seconds = anchor_seconds
        self.conversion_seconds = conversion_seconds
        # fused_bytes(ctx, value, members): what a fused group moves for a value it reads
        # or writes, where not its type's size (a bf16 operand: half)
        self.fused_bytes = fused_bytes
        self.nodes = [n for n in graph.nodes if n.op != "constant"]
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.role: dict[Node, Role] = {}
        self.reason: dict[Node, str] = {}
        for n in self.nodes:
            self.role[n], self.reason[n] = classify(graph, n, fusible)
        for n in apart:  # its result must exist on its own (a mask kept for the backward)
            self.role[n], self.reason[n] = Role.OPAQUE, "kept apart: its result is kept"
        self.users: dict[Value, list[Node]] = graph.users()
        self.graph_outputs = set(graph.outputs)
        # desc[i]: bitset of nodes reachable from node i (itself excluded); anc likewise.
        self.desc = [0] * len(self.nodes)
        self.anc = [0] * len(self.nodes)
        for n in self.nodes:
            i = self.index[n]
            for v in n.inputs:
                p = v.producer
                if p is not None and p in self.index:
                    j = self.index[p]
                    self.anc[i] |= self.anc[j] | (1 << j)
        for n in reversed(self.nodes):
            i = self.index[n]
            for v in n.outputs:
                for u in self.users.get(v, ()):
                    j = self.index[u]
                    self.desc[i] |= self.desc[j] | (1 << j)

    def mask(self, members) -> int:
        m = 0
        for n in members:
            m |= 1 << self.index[n]
        return m

    def between(self, members) -> int:
        """Bitset of the non-members on paths from one member to another."""
        below = above = 0
        for n in members:
            i = self.index[n]
            below |= self.desc[i]
            above |= self.anc[i]
        return below & above & ~self.mask(members)

    def is_convex(self, members) -> bool:
        """No path leaves the group and comes back (else the fused kernel would need its
        own output as an input: a cycle)."""
        return self.between(members) == 0

    def escapes(self, value: Value, members) -> bool:
        """Whether `value` is read outside the group (so the kernel must write it)."""
        return value in self.graph_outputs or any(u not in members for u in self.users.get(value, ()))

    def producer_in(self, value: Value, members) -> bool:
        return value.producer is not None and value.producer in members
