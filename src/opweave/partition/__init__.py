"""Fusion partitioning: which nodes of a graph run together as one kernel.

`partition(graph)` classifies nodes (classify.py), splits the graph into components
(components.py), enumerates the legal groups of each (legality.py), scores them with the
roofline cost model (policy.py) and picks a cover by an ILP (ilp.py) or greedily
(greedy.py). Solutions are cached by the component's structural hash, so repeated layers
are solved once. See docs/fusion.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..cost.model import active as active_machine
from ..ir import Graph
from ..ir.graph import Node
from . import greedy, ilp
from .classify import Fusible, Role
from .components import TooManyCandidates, candidates, components, neighbours, structural_key
from .context import Context
from .cycles import find_cycle
from .legality import why_illegal
from .policy import group_seconds

METHODS = ("ilp", "greedy")
# (method, cost source, capabilities, component key) -> groups by position in the component
_SOLVED: dict[tuple, list[tuple[int, ...]]] = {}


@dataclass
class Partition:
    """A cover of the graph's non-constant nodes by groups, in graph order."""

    ctx: Context
    groups: list[frozenset[Node]]
    method: str
    seconds: float = 0.0                 # time spent solving
    components: int = 0
    cache_hits: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def fused(self) -> list[frozenset[Node]]:
        return [g for g in self.groups if len(g) > 1]

    def estimated_seconds(self) -> float:
        return sum(group_seconds(self.ctx, g) for g in self.groups)

    def ordered(self, group) -> list[Node]:
        return sorted(group, key=self.ctx.index.__getitem__)

    def why_alone(self, node: Node) -> str:
        """Why a node runs by itself: its role's reason, or what stops each fusion."""
        ctx = self.ctx
        if ctx.reason[node]:
            return ctx.reason[node]
        reasons = []
        for v in node.inputs:
            p = v.producer
            if p in ctx.index:
                bad = why_illegal(ctx, frozenset([p, node]))
                reasons.append(f"with {p.op}: {bad or 'legal, not chosen (cost)'}")
        for v in node.outputs:
            for u in ctx.users.get(v, ()):
                bad = why_illegal(ctx, frozenset([node, u]))
                reasons.append(f"with {u.op}: {bad or 'legal, not chosen (cost)'}")
        return "; ".join(reasons) or "no neighbours"


def clear_cache() -> None:
    """Forget solved components (to time solving itself, or after changing costs)."""
    _SOLVED.clear()


def partition(graph: Graph, method: str, fusible: Fusible, ilp_seconds: float = 2.0,
              anchor_seconds=None, apart: frozenset[Node] = frozenset(),
              conversion_seconds=None, costs: tuple = (),
              float32_residuals: bool = False, fused_bytes=None) -> Partition:
    """Groups of `graph` that run as one kernel, given what the code generator can fuse
    (`fusible`). `anchor_seconds(ctx, group)`, if given, is the measured time of a group
    holding a library call (codegen measures the candidates per shape); otherwise the
    roofline. `conversion_seconds(ctx, group)`, if given, is added to a group without a
    library call: what it makes its neighbours convert (a float32 kernel between bf16
    steps), and `fused_bytes(ctx, value, group)`, if given, is the size a fused group moves
    of a value it reads or writes (bf16: half, for one that comes or goes in bf16).
    `costs` names what those depend on beyond the graph (the precision), so a
    solution cached for one is not taken for another. Nodes in `apart` are fused with
    nothing. `float32_residuals`: a product's residual add is never its post-op (bf16: the
    add then sums in float32, not into the product's rounded result)."""
    if method not in METHODS:
        raise ValueError(f"unknown partitioner {method!r}; choose one of {METHODS}")
    start = time.perf_counter()
    ctx = Context(graph, fusible, anchor_seconds, apart, conversion_seconds, float32_residuals,
                  fused_bytes)
    adj = neighbours(ctx)
    comps = components(ctx, adj)
    group_of: dict[Node, frozenset[Node]] = {}
    result = Partition(ctx, [], method, components=len(comps))
    for comp in comps:
        # every input of the solution: the same component costed by measurement or by the
        # roofline, or with other fusible ops, may be covered differently
        key = (method, anchor_seconds is not None, costs, float32_residuals, fusible,
               ilp_seconds, active_machine(), structural_key(ctx, comp))
        if key in _SOLVED:
            result.cache_hits += 1
            chosen = [frozenset(comp[i] for i in local) for local in _SOLVED[key]]
        else:
            chosen = _solve(ctx, comp, adj, method, ilp_seconds, result.notes)
            local = {n: i for i, n in enumerate(comp)}
            _SOLVED[key] = [tuple(sorted(local[n] for n in g)) for g in chosen]
        for g in chosen:
            for n in g:
                group_of[n] = g
    groups = list(dict.fromkeys(group_of.get(n, frozenset([n])) for n in ctx.nodes))
    groups = _break_cycles(ctx, groups, result.notes)
    result.groups = groups
    result.seconds = time.perf_counter() - start
    return result


def _solve(ctx, comp, adj, method, ilp_seconds, notes) -> list[frozenset[Node]]:
    if method == "greedy":
        return greedy.solve(ctx, comp, adj)
    try:
        cands = candidates(ctx, comp, adj)
        costs = [group_seconds(ctx, g) for g in cands]
        return ilp.solve(ctx, comp, cands, costs, ilp_seconds)
    except (TooManyCandidates, ilp.IlpFailed) as err:
        notes.append(f"component of {len(comp)} nodes: ILP not used ({err}); greedy instead")
        return greedy.solve(ctx, comp, adj)


def _break_cycles(ctx, groups, notes):
    """Groups from different components can still depend on each other in a cycle; split
    the largest group of any such cycle into single nodes until none is left."""
    while True:
        cycle = find_cycle(ctx, groups)
        if cycle is None:
            return groups
        worst = max(cycle, key=lambda i: len(groups[i]))
        notes.append(f"split a group of {len(groups[worst])} nodes to break a cycle")
        groups = groups[:worst] + [frozenset([n]) for n in groups[worst]] + groups[worst + 1:]


__all__ = ["Partition", "partition", "METHODS", "Role", "Fusible"]
