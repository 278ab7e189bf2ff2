"""Rematerialization under a memory budget (Checkmate, MLSys'20), over lowered steps.

A training step's peak memory is the activations the backward reads, kept from the
forward. Recomputing some of them in the backward, from values still kept, trades time
for memory. The unit is a lowered step (a fused kernel, a library call, a single op), so
what recomputes is what already runs; a plan is an order of steps in which a step may
appear again, and the executor frees each run's outputs after their own last read.

`plan` takes the cheapest (by the cost model) of four planners' orders whose exact peak
(`problem.live_bytes`) is within the budget: Checkmate's MILP (`milp.py`, when its
program is small enough to solve), Checkmate's rounded relaxation, the greedy
recompute-at-the-peak (`greedy.py`) and segment checkpointing (`segments.py`: what
checkpointing every block does, found from the steps); when none fits, the order of the
lowest peak found (`smallest_peak`); when that does not fit either, the budget is refused
with that peak. Never
recomputed: random steps (dropout's mask would change), steps that write into an input,
steps whose outputs leave the graph.
See docs/memory.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import greedy, milp, segments
from .problem import Problem, analyse, live_bytes, simulate_peak, validate

MILP_MAX_COLUMNS = 60_000  # above this many binaries, the MILP is not tried
MIN_PEAK_PROBES = 5        # MILP solves that look for a lower peak than the greedy floor


class MemoryBudgetError(ValueError):
    """The memory budget is below what any schedule opweave finds can meet. `smallest`
    (bytes) is a budget that is met by the same steps: the lowest peak found
    (`smallest_peak`; a compile that measures library forms may lower to other steps next
    time)."""

    def __init__(self, budget: int, smallest: int, unconstrained: int):
        super().__init__(
            f"a memory budget of {_mib(budget)} cannot be met: the smallest peak opweave's "
            f"rematerialization finds for this graph is {_mib(smallest)} ({smallest} bytes; "
            f"unconstrained: {_mib(unconstrained)})")
        self.budget, self.smallest, self.unconstrained = budget, smallest, unconstrained


@dataclass
class RematPlan:
    """The chosen order of steps (repeats are recomputations) and what it achieves."""

    order: list[int]
    budget: int
    unconstrained_peak: int
    predicted_peak: int
    base_seconds: float         # modelled time of the original steps
    extra_seconds: float = 0.0  # modelled time of the recomputations
    method: str = "none"        # "none", "milp", "lp-rounding", "greedy", "segments", "lowest"
    solve_seconds: float = 0.0
    recomputed: dict[int, int] = field(default_factory=dict)  # step -> extra runs

    def __str__(self) -> str:
        mib = 2 ** 20
        head = (f"peak {self.predicted_peak / mib:.1f} MiB (budget {self.budget / mib:.1f}, "
                f"unconstrained {self.unconstrained_peak / mib:.1f})")
        if self.method == "none":
            return f"{head}: no recomputation needed"
        overhead = self.extra_seconds / self.base_seconds if self.base_seconds else 0.0
        return (f"{head}: {sum(self.recomputed.values())} step run(s) recomputed, modelled "
                f"+{overhead:.1%} time; {self.method}, planned in {self.solve_seconds:.2f} s")


def resolve_budget(budget: int | float, unconstrained: int) -> int:
    """Bytes from a budget given in bytes (an int) or as a fraction of the unconstrained
    peak (a float in (0, 1])."""
    if isinstance(budget, float):
        return int(budget * unconstrained)
    return int(budget)


def plan(problem: Problem, budget: int, *, deterministic: bool = False) -> RematPlan:
    """The cheapest order found whose exact peak is at most `budget` bytes;
    MemoryBudgetError, naming the smallest peak found, when there is none."""
    identity = list(range(problem.n))
    unconstrained = simulate_peak(problem, identity)
    base = problem.seconds
    if unconstrained <= budget:
        return RematPlan(identity, budget, unconstrained, unconstrained, base)
    start = time.perf_counter()
    candidates = [(greedy.recompute_at_peaks(problem, identity, budget), "greedy")]
    segmented = segments.orders(problem)
    candidates += [(order, "segments") for order in segmented]
    program = milp.build(problem, milp.MAX_STAGES)
    if program.columns <= MILP_MAX_COLUMNS:
        found = milp.solve_milp(problem, program, budget, deterministic)
        if found is not None:
            candidates.append((milp.order(problem, program, found), "milp"))
    for found in milp.solve_relaxed(problem, program, budget, deterministic):
        candidates.append((milp.order(problem, program, found), "lp-rounding"))
    best = None
    for order, method in candidates:
        validate(problem, order)
        peak = simulate_peak(problem, order)
        if peak > budget:
            continue
        extra = sum(problem.facts[i].seconds for i in order) - base
        if best is None or (extra, peak) < (best[0], best[1]):
            best = (extra, peak, order, method)
    if best is None:
        lowest, order = smallest_peak(problem, program, deterministic, segmented)
        if lowest > budget:
            raise MemoryBudgetError(budget, lowest, unconstrained)
        best = (sum(problem.facts[i].seconds for i in order) - base, lowest, order, "lowest")
    extra, peak, order, method = best
    counts: dict[int, int] = {}
    for i in order:
        counts[i] = counts.get(i, 0) + 1
    recomputed = {i: c - 1 for i, c in counts.items() if c > 1}
    return RematPlan(order, budget, unconstrained, peak, base, extra, method,
                     time.perf_counter() - start, recomputed)


def smallest_peak(problem: Problem, program: milp.Program, deterministic: bool,
                  segmented: list[list[int]] | None = None) -> tuple[int, list[int]]:
    """The lowest peak found and its order: what a budget below every cheaper plan gets,
    or is told. The greedy planner's floor (it recomputes at the peak with no limit),
    started from the steps' order and from the segment order of the lowest peak
    (`segmented`, default: `segments.orders`), then a bisection between the linear
    relaxation's lower bound and that floor, one MILP solve per probe (`MIN_PEAK_PROBES`
    at most): the MILP with the budget as a column to minimize rarely finds an integer
    solution within its node limit, at a fixed budget it does. The same search at the
    budget it returned finds the same order again, so that budget is met (unless the
    solver's deadline cut a solve short)."""
    if segmented is None:
        segmented = segments.orders(problem)
    starts = [list(range(problem.n))]
    if segmented:
        starts.append(min(segmented, key=lambda o: simulate_peak(problem, o)))
    floors = [greedy.recompute_at_peaks(problem, start, 0) for start in starts]
    high, order = min(((simulate_peak(problem, o), o) for o in floors), key=lambda f: f[0])
    if program.columns > MILP_MAX_COLUMNS:
        return high, order
    low = milp.min_peak_bound(program, deterministic) or 0.0
    for _ in range(MIN_PEAK_PROBES):
        if high - low <= 0.01 * high:
            break
        probe = int((low + high) / 2)
        found = milp.solve_milp(problem, program, probe, deterministic)
        if found is None:
            low = probe
            continue
        candidate = milp.order(problem, program, found)
        validate(problem, candidate)
        peak = simulate_peak(problem, candidate)
        if peak < high:
            high, order = peak, candidate
        else:  # the rows over-count liveness: a solution need not lower the exact peak
            low = probe
    return high, order


def planned_peak(compiled) -> int | None:
    """A compiled graph's (pipeline.CompiledGraph) peak bytes: its plan's, or that of its
    steps in their order when no budget was set; None for a graph run op by op."""
    plan = compiled.report("remat")
    if plan is not None:
        return plan.predicted_peak
    steps = getattr(compiled.executor, "lowered_steps", None)
    if steps is None:
        return None
    problem = analyse(steps, compiled.graph)
    return simulate_peak(problem, range(problem.n))


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f} MiB"


__all__ = ["MemoryBudgetError", "Problem", "RematPlan", "analyse", "live_bytes", "plan", "planned_peak",
           "resolve_budget", "simulate_peak", "smallest_peak", "validate"]
