"""Checkmate's program (MLSys'20), with stages of several steps.

Over stages t and steps i: R[t, i] = step i runs again at the start of stage t, S[t, i]
= its outputs are kept into stage t. Every step reads only kept or recomputed values,
keeping needs the value alive in the stage before, and rows bound the bytes alive at
each stage's start and at each step (`_memory_rows`); the objective is the modelled
time of the recomputations. Checkmate has one stage per step (O(n^2) binaries); here a
stage is a run of consecutive steps, at most `MAX_STAGES` of them. Views are never kept
across stages (they cost nothing to make again, and a kept view would keep its base's
bytes unseen); a value an in-place step wrote into is never kept past it.

`solve_milp` solves it with HiGHS under a node limit (the same answer on any machine)
and a deadline when the compile may use the clock; `solve_relaxed` is Checkmate's fast
path: the linear relaxation, rounded at several thresholds, each rounding completed by
closure. Both return the set of (stage, step) recomputations; `order` turns a set into
the order of steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import Problem

MAX_STAGES = 48            # stages of the program (Checkmate: one per step)
MIP_MAX_NODES = 300        # branch-and-bound nodes per solve (a count: same on any machine)
SOLVE_SECONDS = 10.0       # the solver's deadline when the compile may use the clock
ROUNDING_THRESHOLDS = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)

Recomputations = set[tuple[int, int]]  # (stage, step)


@dataclass
class Program:
    """Variables and rows of the stage-level MILP."""

    stage_of: list[int]
    stages: int
    r: dict[tuple[int, int], int]   # (stage, step) -> column of R
    s: dict[tuple[int, int], int]   # (stage, step) -> column of S
    costs: list[float]
    memory_rows: list[tuple[list[int], list[float], float]]  # per step: columns, bytes, constant
    rows: list[tuple[float, float, list[int], list[float]]]  # lower, upper, columns, coefs

    @property
    def columns(self) -> int:
        return len(self.costs)


def _stages(n: int, count: int) -> list[int]:
    count = max(1, min(n, count))
    return [i * count // n for i in range(n)]


def build(problem: Problem, stages: int) -> Program:
    n, facts = problem.n, problem.facts
    stage_of = _stages(n, stages)
    stages = (stage_of[-1] + 1) if n else 0
    readers: list[list[int]] = [[] for _ in range(n)]
    for g, f in enumerate(facts):
        for i in f.reads:
            readers[i].append(g)
    # needed[k]: steps before stage k whose outputs some step of stage >= k reads, or
    # that a recomputable step needed there reads (the closure through recomputation)
    last_stage_read = [max((stage_of[g] for g in readers[i]), default=-1) for i in range(n)]
    overwritten_at = {f.overwrites: stage_of[g] for g, f in enumerate(facts)
                      if f.overwrites is not None}
    r: dict[tuple[int, int], int] = {}
    s: dict[tuple[int, int], int] = {}
    costs: list[float] = []

    def column(table, key, price):
        table[key] = len(costs)
        costs.append(price)

    needed: list[set[int]] = []
    for k in range(stages):
        direct = {i for i in range(n) if stage_of[i] < k and last_stage_read[i] >= k}
        closure, todo = set(direct), list(direct)
        while todo:
            i = todo.pop()
            if facts[i].recomputable:
                for j in facts[i].reads:
                    if j not in closure:
                        closure.add(j)
                        todo.append(j)
        needed.append(closure)
        for i in sorted(closure):
            if facts[i].recomputable:
                column(r, (k, i), facts[i].seconds)
            kept_ok = not (facts[i].view and facts[i].recomputable) and \
                not (i in overwritten_at and k > overwritten_at[i])
            if kept_ok:
                column(s, (k, i), 0.0)

    rows: list[tuple[float, float, list[int], list[float]]] = []

    def alive(k, i) -> list[int]:
        return [c for c in (s.get((k, i)), r.get((k, i))) if c is not None]

    for g in range(n):  # (a) a stage's own steps read kept or recomputed values
        k = stage_of[g]
        for i in facts[g].reads:
            if stage_of[i] < k:
                cols = alive(k, i)
                rows.append((1.0, math.inf, cols, [1.0] * len(cols)))
    for (k, h), col in r.items():  # (b) a recomputation reads kept or recomputed values
        for i in facts[h].reads:
            if stage_of[i] < k:
                cols = alive(k, i)
                rows.append((0.0, math.inf, cols + [col], [1.0] * len(cols) + [-1.0]))
    for (k, i), col in s.items():  # (c) keeping into stage k needs it alive in stage k-1
        if stage_of[i] < k - 1:
            cols = alive(k - 1, i)
            rows.append((0.0, math.inf, cols + [col], [1.0] * len(cols) + [-1.0]))

    memory_rows = _memory_rows(problem, stage_of, stages, needed, s, alive)
    return Program(stage_of, stages, r, s, costs, memory_rows, rows)


def _memory_rows(problem: Problem, stage_of, stages, needed, s, alive):
    """Rows bounding the bytes alive: one at each stage's start (what is kept into it and
    what it recomputes, all at once), and one per step. At a step, a value from an
    earlier stage counts (kept or recomputed) while a step of this stage still reads it,
    and afterwards only if kept for the next stage; the stage's own values count from
    their step to their last read in the stage, and to its end when kept (their S
    column); the graph's outputs count from their step to the end. A read of a view
    keeps its base's bytes."""
    facts = problem.facts
    producer = {v: g for g, step in enumerate(problem.steps) for v in step.outputs
                if problem.storage.get(v) is v}
    last_read: dict[tuple[int, int], int] = {}  # (stage, step owning bytes) -> last reader
    for g, step in enumerate(problem.steps):
        for v in step.inputs:
            owner = problem.storage.get(v)
            if owner in producer:
                last_read[(stage_of[g], producer[owner])] = g
    outputs_bytes = [sum(v.type.nbytes for v in step.outputs
                         if v in problem.graph_outputs and problem.storage.get(v) is v)
                     for step in problem.steps]
    rows = []
    outputs_so_far = 0
    for g in range(problem.n):
        k = stage_of[g]
        first = g == 0 or stage_of[g - 1] != k
        if first:  # the stage's recomputations
            cols, coefs = [], []
            for i in needed[k]:
                for c in alive(k, i):
                    cols.append(c)
                    coefs.append(float(facts[i].owned))
            rows.append((cols, coefs, float(outputs_so_far)))
        cols, coefs, constant = [], [], outputs_so_far + outputs_bytes[g]
        for i in needed[k]:
            if last_read.get((k, i), -1) >= g:
                chosen = alive(k, i)
            else:
                chosen = [s[(k + 1, i)]] if (k + 1, i) in s else []
            cols.extend(chosen)
            coefs.extend([float(facts[i].owned)] * len(chosen))
        i = g
        while i >= 0 and stage_of[i] == k:
            own = facts[i].owned - outputs_bytes[i]
            if i == g or last_read.get((k, i), -1) >= g:
                constant += own
            elif (k + 1, i) in s:
                cols.append(s[(k + 1, i)])
                coefs.append(float(own))
            i -= 1
        outputs_so_far += outputs_bytes[g]
        rows.append((cols, coefs, float(constant)))
    return rows


def _highs(deterministic: bool):
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 1e-3)
    h.setOptionValue("time_limit", math.inf if deterministic else SOLVE_SECONDS)
    h.setOptionValue("mip_max_nodes", MIP_MAX_NODES)
    return h, highspy


def _solve(program: Program, budget: float | None, integer: bool, deterministic: bool):
    """(column values, objective) of the program under `budget` bytes, or None when no
    solution was found. With `budget=None` the budget is a column of its own (MiB, the
    last value returned) and the objective is that column alone: the smallest peak the
    rows allow, whatever it recomputes."""
    h, highspy = _highs(deterministic)
    m = program.columns
    cols = np.arange(m, dtype=np.int32)
    h.addVars(m, np.zeros(m), np.ones(m))
    if budget is not None:
        h.changeColsCost(m, cols, np.array(program.costs) * 1e6)  # microseconds
    if integer and m:
        h.changeColsIntegrality(m, cols, np.array([highspy.HighsVarType.kInteger] * m))
    inf = highspy.kHighsInf
    if budget is None:  # column m: the budget, in MiB
        h.addVars(1, np.zeros(1), np.array([inf]))
        h.changeColsCost(1, np.array([m], dtype=np.int32), np.ones(1))
    lower, upper, starts, index, value = [], [], [], [], []

    def add(lo, hi, columns, coefs):
        lower.append(lo)
        upper.append(hi)
        starts.append(len(index))
        index.extend(columns)
        value.extend(coefs)

    for lo, hi, columns, coefs in program.rows:
        add(lo, inf if hi == math.inf else hi, columns, coefs)
    mib = 2.0 ** 20  # rows in MiB keep the coefficients near 1
    for columns, coefs, constant in program.memory_rows:
        if budget is None:
            add(-inf, -constant / mib, [*columns, m], [*(c / mib for c in coefs), -1.0])
        else:
            add(-inf, (budget - constant) / mib, columns, [c / mib for c in coefs])
    h.addRows(len(lower), np.array(lower, dtype=float), np.array(upper, dtype=float),
              len(index), np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
              np.array(value, dtype=float))
    h.run()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # 2: feasible
        return None
    return np.array(h.getSolution().col_value), info.objective_function_value


def order(problem: Problem, program: Program, recompute: set[tuple[int, int]]) -> list[int]:
    """Stage by stage: the stage's recomputations (in their original order), then its steps."""
    by_stage: dict[int, list[int]] = {}
    for k, i in recompute:
        by_stage.setdefault(k, []).append(i)
    order: list[int] = []
    for k in range(program.stages):
        order.extend(sorted(by_stage.get(k, ())))
        order.extend(g for g in range(problem.n) if program.stage_of[g] == k)
    return order


def _round(problem: Problem, program: Program, values: np.ndarray, threshold: float):
    """Checkmate's rounding: keep what the relaxation kept at least `threshold`; then
    recompute, stage by stage, whatever is read and neither kept nor recomputed, and
    keep (back to where it was last alive) whatever cannot be recomputed."""
    facts, stage_of = problem.facts, program.stage_of
    keep = {key for key, col in program.s.items() if values[col] >= threshold}
    recompute: set[tuple[int, int]] = set()

    def keep_back(k, i):
        while k > stage_of[i] and (k, i) not in keep:
            if (k, i) not in program.s:
                return False
            keep.add((k, i))
            if (k - 1, i) in recompute:
                break
            k -= 1
        return True

    # keeping into a stage needs the value alive in the stage before
    for k, i in sorted(keep, key=lambda key: -key[0]):
        if k - 1 > stage_of[i] and (k - 1, i) not in keep:
            if not keep_back(k - 1, i):
                return None
    for k in range(program.stages):
        todo = [i for g in range(problem.n) if stage_of[g] == k for i in facts[g].reads
                if stage_of[i] < k]
        while todo:
            i = todo.pop()
            if (k, i) in keep or (k, i) in recompute:
                continue
            if facts[i].recomputable and (k, i) in program.r:
                recompute.add((k, i))
                todo.extend(j for j in facts[i].reads if stage_of[j] < k)
            elif not keep_back(k, i):
                return None
    return recompute


def solve_milp(problem: Problem, program: Program, budget: int,
               deterministic: bool) -> Recomputations | None:
    """The MILP's recomputations, or None when it found no solution within its limits."""
    solved = _solve(program, budget, True, deterministic)
    if solved is None:
        return None
    return {key for key, col in program.r.items() if solved[0][col] > 0.5}


def min_peak_bound(program: Program, deterministic: bool) -> float | None:
    """A lower bound (bytes) on the budget the program's rows admit: the linear relaxation
    with the budget as a column of its own, minimized; None when unsolved. The rows
    over-count liveness, so an order's exact peak may still be lower: a place to start a
    search from, not a proof."""
    solved = _solve(program, None, False, deterministic)
    if solved is None:
        return None
    return float(solved[0][program.columns]) * 2.0 ** 20


def solve_relaxed(problem: Problem, program: Program, budget: int,
                  deterministic: bool) -> list[Recomputations]:
    """The relaxation rounded at each of `ROUNDING_THRESHOLDS` (those that round)."""
    relaxed = _solve(program, budget, False, deterministic)
    if relaxed is None:
        return []
    rounded = (_round(problem, program, relaxed[0], t) for t in ROUNDING_THRESHOLDS)
    return [r for r in rounded if r is not None]

