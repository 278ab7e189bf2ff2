"""The memory plan: value lifetimes, and an arena in which values reuse each other's bytes.

Each step of the plan is a node of the graph. A value is live from the step that makes it
to the last step that reads it or any view of it (a view keeps its base's bytes alive).
Values written by ops that can fill a preallocated tensor (`OpDef.impl_out`) are packed
into one arena with the greedy-by-size offset algorithm (as in TFLite's arena planner):
two values share bytes only if their lifetimes do not overlap. Graph outputs and anything
they alias are never placed in the arena: they are handed to the caller and must stay valid.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import sympy

from ..ir import Graph, Value, symbols

ALIGN = 64


@dataclass
class MemoryPlan:
    last_use: dict[Value, int]            # step index after which the value may be dropped
    offsets: dict[Value, int]             # arena byte offset of planned values
    arena_bytes: int
    frees: list[list[Value]] = field(default_factory=list)  # values to drop after each step
    unplanned_peak_bytes: int = 0         # peak of live intermediates with no reuse at all

    def summary(self) -> str:
        return (f"arena {self.arena_bytes / 2**20:.1f} MiB for {len(self.offsets)} values "
                f"(no reuse would need {self.unplanned_peak_bytes / 2**20:.1f} MiB at peak)")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(graph: Graph) -> MemoryPlan:
    steps = graph.nodes
    end = len(steps)
    base, born, last, base_last = _lifetimes(graph)  # a base lives as long as its views
    escaping = {base.get(v, v) for v in graph.outputs}

    frees: list[list[Value]] = [[] for _ in steps]
    for v, i in last.items():
        if i < end and v.producer is not None and v.producer.op != "constant":
            frees[i].append(v)

    planned = [v for node in steps for v in node.outputs
               if node.opdef.impl_out is not None and len(node.outputs) == 1
               and base[v] is v and v not in escaping and v.type.nbytes > 0]
    intervals = {v: (born[v], base_last[v]) for v in planned}
    offsets: dict[Value, int] = {}
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, start, end)
    for v in sorted(planned, key=lambda v: (-v.type.nbytes, born[v])):
        size = _align(v.type.nbytes)
        start, stop = intervals[v]
        conflicts = sorted((o, s) for o, s, a, b in placed if a <= stop and start <= b)
        offset = 0
        for o, s in conflicts:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        offsets[v] = offset
        placed.append((offset, size, start, stop))
    arena = max((o + s for o, s, _, _ in placed), default=0)

    return MemoryPlan(last, offsets, arena, frees, _live_peak(steps, base, base_last))


def _lifetimes(graph: Graph):
    """(value -> the value owning its bytes, value -> step made, value -> last step
    reading it, owner -> last step any view of it is read); graph outputs live past the
    last step."""
    base: dict[Value, Value] = {}
    born: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for i, node in enumerate(graph.nodes):
        for v in node.outputs:
            born[v] = i
            last[v] = i
            base[v] = base.get(node.inputs[0], node.inputs[0]) if node.opdef.is_view else v
        for v in node.inputs:
            last[v] = i
    for v in graph.outputs:
        last[v] = len(graph.nodes)
    base_last: dict[Value, int] = {}
    for v, b in base.items():
        base_last[b] = max(base_last.get(b, 0), last.get(v, born[v]))
    return base, born, last, base_last


def _live_peak(steps, base, base_last):
    """The most bytes of intermediates (and outputs) alive at once with no reuse; over
    symbolic sizes, an expression (sympy's Max of the candidates it cannot order)."""
    live_bytes, peak = 0, 0
    owned = {v for v in base if base[v] is v and v.producer is not None and v.producer.op != "constant"}
    ends: dict[int, int] = {}
    for v in owned:
        ends[base_last[v]] = ends.get(base_last[v], 0) + v.type.nbytes
    for i, node in enumerate(steps):
        live_bytes += sum(v.type.nbytes for v in node.outputs if v in owned)
        peak = max(peak, live_bytes) if symbols.is_static([peak, live_bytes]) \
            else sympy.Max(peak, live_bytes)
        live_bytes -= ends.get(i, 0)
    return peak


def symbolic_peak(graph: Graph):
    """The peak bytes of `graph` run node by node, as a function of its size symbols: a
    bound for any binding before fusion (fused plans keep fewer intermediates)."""
    base, _, _, base_last = _lifetimes(graph)
    return _live_peak(graph.nodes, base, base_last)


def free_points(steps: Sequence, keep: frozenset[Value] | set) -> list[list[Value]]:
    """For steps run in this order (a step may repeat), the values to drop after each:
    each write of a value lives until its last read before the next write, or only
    through its own step when nothing reads it; `keep` (the graph's outputs) never
    drops. The executor frees by this list; schedule/remat/problem.py's `live_bytes`
    counts by it."""
    frees: list[list[Value]] = [[] for _ in steps]
    last: dict[Value, int] = {}

    def release(v: Value) -> None:
        i = last.pop(v, None)
        if i is not None and v not in keep:
            frees[i].append(v)

    for i, step in enumerate(steps):
        for v in step.inputs:
            if v in last:
                last[v] = i
        for v in step.outputs:
            release(v)
            last[v] = i
    for v in list(last):
        release(v)
    return frees
