"""Extraction: choose one e-node per needed class so the resulting graph costs least.

`greedy` is the classic bottom-up extractor (Knuth's generalization of Dijkstra): each
class gets its cheapest e-node by tree cost. It is fast and always acyclic, but counts a
shared subterm once per use, so it undervalues sharing (a merged Q/K/V matmul feeds three
users). `ilp` is Tensat's formulation, solved with HiGHS: a binary per e-node, every
chosen node's children must have a chosen node, the roots must, and order variables on
classes forbid cycles; the objective counts each chosen node once (true DAG cost). The
greedy choice seeds the solver, so a time limit still returns something at least as good.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .term import ENode, children_first

# The solver sees microseconds (seconds are too small for its tolerances). It stops when
# within half a microsecond of optimal: a relative gap would hide the rewrites that save a
# few kernel launches in a graph dominated by long GEMMs; the time limit bounds the search.
COST_SCALE = 1e6
MIP_ABS_GAP = 0.5

CostFn = Callable[[int, ENode], float]  # (class, e-node) -> cost of that node alone


@dataclass
class Extraction:
    choice: dict[int, ENode]
    cost: float
    method: str
    seconds: float
    status: str = ""


def dag_cost(choice: dict[int, ENode], roots: list[int], cost: CostFn) -> float:
    """Cost of the graph a choice describes: each reachable class counted once."""
    return sum(cost(cid, choice[cid]) for cid in children_first(choice, roots))


def greedy(members: dict[int, list[ENode]], roots: list[int], cost: CostFn) -> Extraction:
    start = time.perf_counter()
    parents: dict[int, list[tuple[int, ENode]]] = {}
    waiting: dict[tuple[int, ENode], int] = {}
    heap: list[tuple[float, int, int, ENode]] = []
    tie = 0
    for cid, nodes in members.items():
        for node in nodes:
            kids = set(node.children)
            if cid in kids:
                continue  # a node that contains its own class can never be chosen
            waiting[(cid, node)] = len(kids)
            for child in kids:
                parents.setdefault(child, []).append((cid, node))
            if not kids:
                heap.append((cost(cid, node), tie, cid, node))
                tie += 1
    heapq.heapify(heap)
    best: dict[int, float] = {}
    choice: dict[int, ENode] = {}
    while heap:
        total, _, cid, node = heapq.heappop(heap)
        if cid in best:
            continue
        best[cid], choice[cid] = total, node
        for parent, pnode in parents.get(cid, ()):
            key = (parent, pnode)
            waiting[key] -= 1
            if waiting[key] == 0 and parent not in best:
                t = cost(parent, pnode) + sum(best[c] for c in set(pnode.children))
                heapq.heappush(heap, (t, tie, parent, pnode))
                tie += 1
    missing = [r for r in roots if r not in choice]
    if missing:
        raise ValueError(f"no acyclic term for classes {missing}")
    return Extraction(choice, dag_cost(choice, roots, cost), "greedy", time.perf_counter() - start)


# Rounds of cycle cuts before extraction gives up on the ILP (greedy's result is used): a
# training graph of small BERT needed 80 rounds and 115 s to reach 0.5% below greedy.
MAX_ROUNDS = 6
# HiGHS branch-and-bound nodes per round: a count, so a round ends alike on any machine
MAX_MIP_NODES = 20_000


def ilp(members: dict[int, list[ENode]], roots: list[int], cost: CostFn, *,
        time_limit: float = 5.0, seed: Extraction | None = None,
        max_rounds: int = MAX_ROUNDS) -> Extraction:
    """Tensat's ILP (HiGHS) over the classes reachable from the roots.

    The acyclicity constraints are added lazily: solve without them, and when the chosen
    nodes form a cycle, order the classes on it and solve again. Their big-M rows weaken
    the LP relaxation, so adding only the few that matter keeps HiGHS fast. Besides the
    deadline, `max_rounds` bounds the work by a count (the bound that decides when there
    is no deadline: the same outcome on every machine)."""
    start = time.perf_counter()
    deadline = start + time_limit
    model = _Model(members, roots, cost)
    if seed is not None:
        model.warm_start(seed)
    rounds = 0
    while True:
        rounds += 1
        left = deadline - time.perf_counter()
        if left <= 0 or rounds > max_rounds:
            raise TimeoutError(f"cycles remain after {rounds - 1} round(s)")
        # each round may take half of what is left: a round that ends in a cycle must
        # leave time for the next
        choice, status = model.solve(max(left / 2, 0.05))
        cyclic = _cyclic_components(choice, roots)
        if not cyclic:
            break
        for component in cyclic:  # every cycle of this round at once: BERT's 12 layers
            model.order(component)  # each close one, which one cut a round never reached
    return Extraction(choice, dag_cost(choice, roots, cost), "ilp", time.perf_counter() - start,
                      f"{status}, {rounds} round(s), {len(model.ordered)} ordered classes")


class _Model:
    """x[n] = 1 when e-node n is chosen; t[c] orders the classes that take part in cycles."""

    def __init__(self, members, roots, cost):
        import highspy

        self.hs = highspy
        classes = _reachable(members, roots)
        self.roots = list(roots)
        self.nodes = [(cid, n) for cid in classes for n in members[cid] if cid not in n.children]
        self.node_index = {key: i for i, key in enumerate(self.nodes)}
        self.by_class: dict[int, list[int]] = {cid: [] for cid in classes}
        for i, (cid, _) in enumerate(self.nodes):
            self.by_class[cid].append(i)
        self.eps = 1.0 / (len(classes) + 1)
        self.ordered: dict[int, int] = {}  # class -> its order variable
        h = self.h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", MIP_ABS_GAP)
        h.setOptionValue("threads", 1)
        n = len(self.nodes)
        h.addVars(n, np.zeros(n), np.ones(n))
        h.changeColsCost(n, np.arange(n, dtype=np.int32),
                         np.array([cost(cid, node) * COST_SCALE for cid, node in self.nodes]))
        h.changeColsIntegrality(n, np.arange(n, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * n))
        inf = highspy.kHighsInf
        for root in set(roots):
            idx = self.by_class[root]
            h.addRow(1.0, inf, len(idx), np.array(idx, dtype=np.int32), np.ones(len(idx)))
        for i, (cid, node) in enumerate(self.nodes):
            for child in set(node.children):  # chosen node => its child class has a chosen node
                idx = [i] + self.by_class[child]
                vals = [-1.0] + [1.0] * len(self.by_class[child])
                h.addRow(0.0, inf, len(idx), np.array(idx, dtype=np.int32), np.array(vals))
        self._seed: Extraction | None = None

    def order(self, cycle: list[int]) -> None:
        """Give the classes of `cycle` order variables and forbid cycles among ordered ones."""
        h, inf, big = self.h, self.hs.kHighsInf, 2.0
        new = [c for c in cycle if c not in self.ordered]
        for cid in new:
            self.ordered[cid] = h.getNumCol()
            h.addVar(0.0, 1.0)
        for i, (cid, node) in enumerate(self.nodes):
            if cid not in self.ordered:
                continue
            for child in set(node.children):
                if child in self.ordered and (cid in new or child in new):
                    # chosen => t[class] >= t[child] + eps
                    cols = np.array([self.ordered[cid], self.ordered[child], i], dtype=np.int32)
                    h.addRow(self.eps - big, inf, 3, cols, np.array([1.0, -1.0, -big]))
        if self._seed is not None:
            self.warm_start(self._seed)

    def warm_start(self, seed: Extraction) -> None:
        self._seed = seed
        values = np.zeros(self.h.getNumCol())
        used = children_first(seed.choice, self.roots)
        rank = {cid: k for k, cid in enumerate(used)}
        for cid, col in self.ordered.items():
            values[col] = (rank.get(cid, 0) + 1) / (len(rank) + 2)
        for cid in used:
            i = self.node_index.get((cid, seed.choice[cid]))
            if i is not None:
                values[i] = 1.0
        sol = self.hs.HighsSolution()
        sol.col_value = list(values)
        self.h.setSolution(sol)

    def solve(self, seconds: float) -> tuple[dict[int, ENode], str]:
        h = self.h
        h.setOptionValue("time_limit", float(seconds))
        h.setOptionValue("mip_max_nodes", MAX_MIP_NODES)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        if h.getInfo().primal_solution_status != 2:  # 2: a feasible solution exists
            raise TimeoutError(f"HiGHS found no solution ({status})")
        values = h.getSolution().col_value
        choice: dict[int, ENode] = {}
        for i, (cid, node) in enumerate(self.nodes):
            # several chosen nodes in one class: keep the one with fewest children
            if values[i] > 0.5 and (cid not in choice or
                                    len(node.children) < len(choice[cid].children)):
                choice[cid] = node
        return choice, status


def _cyclic_components(choice: dict[int, ENode], roots: list[int]) -> list[list[int]]:
    """The classes of each strongly connected component of the chosen nodes reachable
    from `roots` that holds a cycle (Tarjan's algorithm, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: list[list[int]] = []
    for root in roots:
        if root in index:
            continue
        work = [(root, iter(choice[root].children))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            cid, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(choice[child].children)))
                elif child in on_stack:
                    low[cid] = min(low[cid], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[cid])
            if low[cid] == index[cid]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == cid:
                        break
                if len(component) > 1 or cid in choice[cid].children:
                    found.append(component)
    return found


def _reachable(members: dict[int, list[ENode]], roots: list[int]) -> list[int]:
    seen, stack = set(), list(roots)
    while stack:
        cid = stack.pop()
        if cid in seen:
            continue
        seen.add(cid)
        for node in members[cid]:
            stack.extend(c for c in node.children if c not in seen)
    return sorted(seen)
