"""The greedy partitioner: the ILP's comparator and its fallback.

Nodes are visited in graph order; each joins the group of one of its producers when the
union is legal and cheaper than keeping them apart (the largest saving wins), otherwise
it starts a group of its own. Same legality and cost as the ILP, so the two compare
head to head; greedy cannot pass through an illegal intermediate group (a reshape at the
end of an epilogue chain, say) that a complete solution would not contain.
"""
from __future__ import annotations

from ..ir.graph import Node
from .context import Context
from .legality import why_illegal
from .policy import group_seconds


def solve(ctx: Context, comp: list[Node], adj) -> list[frozenset[Node]]:
    group_of: dict[Node, frozenset[Node]] = {}
    for node in comp:
        best, gain = None, 0.0
        own = group_seconds(ctx, [node])
        for v in node.inputs:
            p = v.producer
            if p not in group_of or node not in adj[p]:
                continue
            group = group_of[p]
            merged = group | {node}
            if why_illegal(ctx, merged) is not None:
                continue
            saving = group_seconds(ctx, group) + own - group_seconds(ctx, merged)
            if saving > gain:
                best, gain = merged, saving
        if best is None:
            group_of[node] = frozenset([node])
        else:
            for m in best:
                group_of[m] = best
    return list(dict.fromkeys(group_of[n] for n in comp))
