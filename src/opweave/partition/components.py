"""Split a graph into independent partitioning problems and enumerate their candidates.

A component is a connected set of nodes joined by edges along which fusion is possible
(anchor to epilogue, one-to-one to one-to-one or row reduction, views in epilogues).
Candidates are the legal, connected node sets of a component up to MAX_GROUP nodes,
grown from each node and pruned as soon as no superset could be legal: besides the
monotone rules of legality, a set with a path through a node outside the component can
never become convex by growing inside it. Components are
keyed by a structural hash so that the 12 or 24 identical layers of a transformer are
solved once.
"""
from __future__ import annotations

import hashlib

from ..ir.graph import Node
from .classify import Role, constant_of
from .context import Context
from .legality import monotone_violation, why_illegal

MAX_GROUP = 12          # nodes per candidate group
MAX_CANDIDATES = 4000   # per component; beyond it the greedy partitioner takes over


class TooManyCandidates(Exception):
    pass


def fusible_edge(ctx: Context, producer: Node, consumer: Node) -> bool:
    a, b = ctx.role.get(producer), ctx.role.get(consumer)
    if a is None or b is None or Role.OPAQUE in (a, b):
        return False
    if b is Role.ANCHOR:                     # no prologue fusion into library calls
        return False
    if a is Role.COLUMN_SUM:                 # complete only after the kernel's last row
        return False
    if a is Role.VIEW:
        return producer.op == "reshape" and b not in (Role.ROW_REDUCE, Role.COLUMN_SUM)
    if b is Role.VIEW:
        return consumer.op == "reshape" and a in (Role.ANCHOR, Role.POINTWISE)
    return True


def neighbours(ctx: Context) -> dict[Node, set[Node]]:
    adj: dict[Node, set[Node]] = {n: set() for n in ctx.nodes}
    for n in ctx.nodes:
        for v in n.inputs:
            p = v.producer
            if p in adj and fusible_edge(ctx, p, n):
                adj[p].add(n)
                adj[n].add(p)
    return adj


def components(ctx: Context, adj) -> list[list[Node]]:
    """Connected components of two or more nodes, each in graph order."""
    seen: set[Node] = set()
    out = []
    for n in ctx.nodes:
        if n in seen or not adj[n]:
            continue
        stack, comp = [n], []
        seen.add(n)
        while stack:
            m = stack.pop()
            comp.append(m)
            for k in adj[m]:
                if k not in seen:
                    seen.add(k)
                    stack.append(k)
        out.append(sorted(comp, key=ctx.index.__getitem__))
    return out


def candidates(ctx: Context, comp: list[Node], adj) -> list[frozenset[Node]]:
    """Every legal connected group of the component (singletons included)."""
    inside = set(comp)
    outside = ~ctx.mask(comp)
    found: set[frozenset[Node]] = set()
    seen: set[frozenset[Node]] = set()
    stack = [frozenset([n]) for n in comp]
    while stack:
        group = stack.pop()
        if group in seen:
            continue
        seen.add(group)
        if len(seen) > MAX_CANDIDATES * 4:
            raise TooManyCandidates(f"{len(comp)} nodes")
        if why_illegal(ctx, group) is None:
            found.add(group)
            if len(found) > MAX_CANDIDATES:
                raise TooManyCandidates(f"{len(comp)} nodes")
        if len(group) >= MAX_GROUP:
            continue
        frontier = {k for m in group for k in adj[m] if k in inside and k not in group}
        for k in frontier:
            bigger = group | {k}
            if (bigger not in seen and monotone_violation(ctx, bigger) is None
                    and not ctx.between(bigger) & outside):
                stack.append(bigger)
    return sorted(found, key=lambda g: (len(g), sorted(ctx.index[n] for n in g)))


def structural_key(ctx: Context, comp: list[Node]) -> str:
    """A hash equal for components that partition the same way: ops, attributes, types,
    internal edges, which values escape, and which members reach each other outside."""
    local = {n: i for i, n in enumerate(comp)}
    mask = ctx.mask(comp)
    parts = []
    for n in comp:
        ins = []
        for v in n.inputs:
            p = v.producer
            if p in local:
                ins.append(f"n{local[p]}.{p.outputs.index(v)}")
            else:
                ins.append(f"x:{v.type}:{'c' if constant_of(ctx.graph, v) is not None else ''}")
        escapes = [int(ctx.escapes(v, comp)) for v in n.outputs]
        # members reachable from n by paths that leave the component
        outside = 0
        for v in n.outputs:
            for u in ctx.users.get(v, ()):
                if u in ctx.index and u not in local:
                    outside |= ctx.desc[ctx.index[u]] | (1 << ctx.index[u])
        reach = sorted(local[m] for m in comp if outside & mask & (1 << ctx.index[m]))
        parts.append(f"{ctx.role[n].value}:{n.op}{sorted(n.attrs.items())}({','.join(ins)})->"
                     f"{[str(v.type) for v in n.outputs]}{escapes}{reach}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]
