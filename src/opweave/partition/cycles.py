"""Cycles among fused groups: group A depends on B if a node of B reaches a node of A."""
from __future__ import annotations

from .context import Context


def find_cycle(ctx: Context, groups) -> list[int] | None:
    """Positions (in `groups`) of groups forming a dependency cycle, or None. Only groups
    of two or more nodes can take part: a convex group and a single node cannot."""
    multi = [i for i, g in enumerate(groups) if len(g) > 1]
    masks = {i: ctx.mask(groups[i]) for i in multi}
    reach = {}
    for i in multi:
        r = 0
        for node in groups[i]:
            r |= ctx.desc[ctx.index[node]]
        reach[i] = r & ~masks[i]
    succ = {i: [j for j in multi if j != i and reach[i] & masks[j]] for i in multi}
    state: dict[int, int] = {}   # 1 on the path, 2 done
    for start in multi:
        if state.get(start):
            continue
        path, stack = [], [(start, iter(succ[start]))]
        state[start] = 1
        path.append(start)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt):]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(succ[nxt])))
    return None
