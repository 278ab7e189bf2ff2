"""Equality saturation: grow the e-graph with every rule until nothing changes or a limit
(iterations, e-nodes, seconds) stops it.

Each iteration matches all rules on one snapshot (rule sets in priority order, so when a
limit cuts an iteration short, the higher-priority sets have run), sends the unions to
egglog, and reads the e-graph back. It is saturated when an iteration adds nothing.

Scheduling follows egg's backoff scheduler: a rule that matches more than its budget in
one iteration (commutativity and associativity on a large graph) is banned for a while,
and its budget and ban double each time, so explosive rules cannot starve the others.
Constant folding is never banned (`Rule.may_be_banned`), and an iteration in which a
banned rule sat out is not saturation: once Inception-v3's e-graph passed 1,000 nodes,
folding was banned and the search stopped "saturated" with 73 of its 94 batch norms still
computed at every call.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass

from .egraph import EGraph, Snapshot
from .pattern import build_index, find
from .rule import Builder, Reject, Rule
from .term import TermDag


@dataclass(frozen=True)
class Limits:
    iterations: int = 12
    nodes: int = 30_000
    seconds: float = 4.0
    match_budget: int = 1_000  # matches of one rule in one iteration before it is banned


@dataclass
class Saturation:
    snapshot: Snapshot
    iterations: int
    stop: str                     # "saturated", "iterations", "nodes" or "time"
    seconds: float


def load(dag: TermDag) -> EGraph:
    """An e-graph holding the dag's reachable classes, under their own ids."""
    egraph = EGraph(dag.store)
    for cid in dag.reachable():
        egraph.insert(cid, dag.node_of[cid])
    egraph.take_snapshot()
    return egraph


def saturate(dag: TermDag, rules: list[Rule], limits: Limits = Limits()) -> Saturation:
    start = time.perf_counter()
    deadline = start + limits.seconds
    egraph = load(dag)
    snap = egraph.snapshot
    bans: Counter = Counter()               # rule -> times banned
    banned_until: dict[str, int] = {}
    stop, iteration = "iterations", 0
    for iteration in range(1, limits.iterations + 1):
        index = build_index(snap)
        before = (snap.node_count, len(snap.members))
        for rule in rules:
            if time.perf_counter() > deadline:
                break
            if banned_until.get(rule.name, 0) >= iteration:
                continue
            budget = limits.match_budget << bans[rule.name]
            limit = budget + 1 if rule.may_be_banned else sys.maxsize
            matches = list(find(snap, rule.lhs, index, limit))
            if rule.may_be_banned and len(matches) > budget:
                banned_until[rule.name] = iteration + (1 << bans[rule.name])
                bans[rule.name] += 1
                continue
            builder = Builder(snap, egraph, dag.store, rule.name)
            for m in matches:
                builder.locate(m)
                try:
                    new = rule.apply(builder, m)
                except Reject:
                    continue
                for root, cid in zip(m.roots, new):
                    if snap.find(root) != snap.find(cid):
                        egraph.union(root, cid)
        snap = egraph.take_snapshot()
        if (snap.node_count, len(snap.members)) == before and time.perf_counter() <= deadline:
            # saturated only if no rule sat this iteration out (banned until it, or later)
            if not any(until >= iteration for until in banned_until.values()):
                stop = "saturated"
                break
            banned_until.clear()  # quiet: let the banned rules run again
        if snap.node_count > limits.nodes:
            stop = "nodes"
            break
        if time.perf_counter() > deadline:
            stop = "time"
            break
    return Saturation(snap, iteration, stop, time.perf_counter() - start)
