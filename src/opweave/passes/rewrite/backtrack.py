"""TASO's cost-bounded backtracking search, kept as the comparator for equality saturation.

Graphs wait in a queue ordered by cost. The cheapest is taken; every match of every rule
in it gives a new graph (the matched roots replaced); graphs costing more than `alpha`
times the best so far are dropped, and a graph seen before is not queued twice. The search
stops when the queue is empty or the time is up, and returns the cheapest graph seen.
Constant folding is not a search decision: every queued graph is folded first (TASO's
graphs likewise have their weights preprocessed), so a merge is costed with its
concatenated weights already computed.
Each step rewrites one place and copies the graph, which is why it needs far more time
than equality saturation to reach the same graphs (Tensat's observation).
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

from .extract import CostFn, dag_cost
from .pattern import build_index, find
from .rule import Builder, Reject, Rule
from .term import TermDag


@dataclass
class SearchResult:
    dag: TermDag
    cost: float
    expanded: int
    queued: int
    seconds: float
    stop: str

    def summary(self) -> str:
        return (f"backtracking: {self.expanded} graphs expanded, {self.queued} queued, "
                f"stopped: {self.stop}, {self.seconds:.2f} s")


def backtrack(dag: TermDag, rules: list[Rule], cost: CostFn, *, alpha: float = 1.05,
              seconds: float = 10.0, max_expansions: int = 100_000) -> SearchResult:
    start = time.perf_counter()
    deadline = start + seconds

    def total(d: TermDag) -> float:
        return dag_cost(d.node_of, d.roots, cost)

    folding = [r for r in rules if r.ruleset == "fold"]
    dag = _fold(dag, folding)
    best, best_cost = dag, total(dag)
    tie = itertools.count()
    queue = [(best_cost, next(tie), dag)]
    seen = {_signature(dag)}
    expanded, stop = 0, "exhausted"
    while queue:
        if time.perf_counter() > deadline:
            stop = "time"
            break
        if expanded >= max_expansions:
            stop = "expansions"
            break
        current_cost, _, current = heapq.heappop(queue)
        expanded += 1
        index = build_index(_Live(current))
        for rule in rules:
            builder = Builder(current, current, current.store, rule.name)
            for m in find(_Live(current), rule.lhs, index):
                builder.locate(m)
                try:
                    new = rule.apply(builder, m)
                except Reject:
                    continue
                candidate = _fold(current.substitute(
                    {root: cid for root, cid in zip(m.roots, new) if root != cid}), folding)
                signature = _signature(candidate)
                if signature in seen:
                    continue
                seen.add(signature)
                c = total(candidate)
                if c < best_cost:
                    best, best_cost = candidate, c
                if c <= alpha * best_cost:
                    heapq.heappush(queue, (c, next(tie), candidate))
            if time.perf_counter() > deadline:
                break
    return SearchResult(best, best_cost, expanded, len(seen), time.perf_counter() - start, stop)


def _fold(dag: TermDag, folding: list[Rule]) -> TermDag:
    """`dag` with every foldable op replaced by the constant it computes."""
    while True:
        live = _Live(dag)
        replace: dict[int, int] = {}
        for rule in folding:
            builder = Builder(dag, dag, dag.store, rule.name)
            for m in find(live, rule.lhs, build_index(live)):
                builder.locate(m)
                try:
                    replace[m.root] = rule.apply(builder, m)[0]
                except Reject:
                    continue
        if not replace:
            return dag
        dag = dag.substitute(replace)


class _Live:
    """A dag seen through its reachable classes only (rule building adds dead nodes)."""

    def __init__(self, dag: TermDag):
        self.dag = dag
        self._classes = dag.reachable()

    def classes(self):
        return self._classes

    def enodes(self, cid):
        return self.dag.enodes(cid)

    def type(self, cid):
        return self.dag.type(cid)

    def constant(self, cid):
        return self.dag.constant(cid)

    def constant_name(self, cid):
        return self.dag.constant_name(cid)


def _signature(dag: TermDag) -> tuple:
    """A structural hash of the graph (equal graphs built through different class ids
    hash alike)."""
    memo: dict[int, int] = {}
    for cid in dag.reachable():
        node = dag.node_of[cid]
        memo[cid] = hash((node.op, node.attrs, tuple(memo[c] for c in node.children)))
    return tuple(memo[r] for r in dag.roots)
