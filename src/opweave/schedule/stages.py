"""Inter-operator stage scheduling: IOS's dynamic program, with FastT's critical-path list
scheduler and plain sequential execution as the baselines it is compared with.

A schedule is a list of stages run one after another. A stage is one or more groups run
concurrently, each group's steps in order on its share of the cores: one group takes
them all (a plain step, or a chain merged into one stage), k groups take cores // k each,
or one thread each where the runtime gives a concurrent group one thread
(`Problem.group_threads`: the native plan's, schedule/concurrent.py).
Costs come from `seconds(step, threads)` (measured, or a cost model) plus `sync`, the
price of forking and joining a concurrent stage.

IOS (Ding et al., MLSys'21): `best[S]`, the least latency of a set S of steps closed under
predecessors, is the minimum over the stages T that can end it (S - T closed) of
`best[S - T] + cost(T)`. T is one step with every core, or 2..`max_groups` independent
chains of at most `max_stage` steps in all, side by side (a chain's steps run in order in
its group; several steps merged into one group cost what they cost one stage after
another, so single steps cover those). The search goes size by size and keeps the
`beam` cheapest states of each size: a model's many independent steps would otherwise
make the sets of scheduled steps countless; a stage's chains start from the costliest
ready steps (see `_endings`). The result is compared with
the sequential and critical-path schedules and the fastest returned.

This module is the scheduling algorithm; schedule/concurrent.py runs its schedules on the
native plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

Seconds = Callable[[int, int], float]  # (step, threads) -> seconds


@dataclass(frozen=True)
class Stage:
    groups: tuple[tuple[int, ...], ...]   # each group's steps, in the order they run
    threads: tuple[int, ...]              # each group's share of the cores

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(i for g in self.groups for i in g)


@dataclass
class Problem:
    preds: list[frozenset[int]]           # each step's predecessors (steps in topological order)
    seconds: Seconds
    cores: int
    sync: float = 5e-6
    # steps that may not run at the same time (one writes what the other reads)
    exclusive: Callable[[int, int], bool] = lambda a, b: False
    # the threads of each group in a concurrent stage: None, cores // groups; or a fixed
    # count (1 on the native plan, whose concurrent groups run on one thread each)
    group_threads: int | None = None

    def share(self, groups: int) -> int:
        return self.group_threads or self.cores // groups

    @functools.cached_property
    def successors(self) -> list[list[int]]:
        return _successors(self)

    @property
    def n(self) -> int:
        return len(self.preds)


def stage_seconds(problem: Problem, stage: Stage) -> float:
    times = [sum(problem.seconds(i, t) for i in g) for g, t in zip(stage.groups, stage.threads)]
    return max(times) + (problem.sync if len(stage.groups) > 1 else 0.0)


def latency(problem: Problem, stages: Sequence[Stage]) -> float:
    return sum(stage_seconds(problem, s) for s in stages)


def valid(problem: Problem, stages: Sequence[Stage]) -> str | None:
    """Why `stages` is not a schedule of the problem (None when it is): every step once,
    each after its predecessors (an earlier stage, or earlier in its own group), no two
    exclusive steps in different groups of one stage, threads within the cores."""
    order = [i for stage in stages for i in stage.steps]
    if sorted(order) != list(range(problem.n)):
        return "not every step runs exactly once"
    done: set[int] = set()
    for k, stage in enumerate(stages):
        if sum(stage.threads) > problem.cores or min(stage.threads) < 1:
            return f"stage {k} uses {stage.threads} threads of {problem.cores} cores"
        for group in stage.groups:
            before = set(done)
            for i in group:
                missing = problem.preds[i] - before
                if missing:
                    return f"step {i} runs in stage {k} before its predecessors {sorted(missing)}"
                before.add(i)
        for a, ga in enumerate(stage.groups):
            for gb in stage.groups[a + 1:]:
                if any(problem.exclusive(i, j) for i in ga for j in gb):
                    return f"stage {k} runs exclusive steps concurrently"
        done.update(stage.steps)
    return None


def sequential(problem: Problem) -> list[Stage]:
    return [Stage(((i,),), (problem.cores,)) for i in range(problem.n)]


def critical_path(problem: Problem) -> list[Stage]:
    """FastT's baseline: at each stage, the ready steps of the longest remaining paths run
    side by side, one per share of the cores (up to `cores` of them)."""
    succs = problem.successors
    level = [0.0] * problem.n
    for i in reversed(range(problem.n)):
        level[i] = problem.seconds(i, problem.cores) + max((level[s] for s in succs[i]),
                                                           default=0.0)
    done: set[int] = set()
    stages = []
    while len(done) < problem.n:
        ready = sorted((i for i in range(problem.n) if i not in done and problem.preds[i] <= done),
                       key=lambda i: (-level[i], i))
        chosen: list[int] = []
        for i in ready:
            if len(chosen) < problem.cores and not any(problem.exclusive(i, j) for j in chosen):
                chosen.append(i)
        share = problem.cores if len(chosen) == 1 else problem.share(len(chosen))
        stages.append(Stage(tuple((i,) for i in chosen), (share,) * len(chosen)))
        done.update(chosen)
    return stages


def ios(problem: Problem, max_stage: int = 4, max_groups: int | None = None,
        beam: int = 16) -> list[Stage]:
    """The least-latency schedule the bounded search finds (see the module's docstring),
    never slower than the sequential or critical-path schedule."""
    return min((search(problem, max_stage, max_groups, beam), critical_path(problem),
                sequential(problem)), key=lambda schedule: latency(problem, schedule))


def search(problem: Problem, max_stage: int = 4, max_groups: int | None = None,
           beam: int = 16) -> list[Stage]:
    """IOS's dynamic program, bounded by `max_stage`, `max_groups` and `beam`."""
    max_groups = min(max_groups or problem.cores, problem.cores)
    start: frozenset[int] = frozenset()
    best: dict[frozenset[int], tuple[float, frozenset[int] | None, Stage | None]] = {
        start: (0.0, None, None)}
    levels: dict[int, set[frozenset[int]]] = {0: {start}}
    for size in range(problem.n):  # a state's value is final before it is extended
        kept = sorted(levels.pop(size, ()), key=lambda state: best[state][0])[:beam]
        for state in kept:
            so_far = best[state][0]
            for block, pieces in _endings(problem, state, max_stage, max_groups):
                stage = _stage(problem, block, pieces)
                nxt = state | block
                total = so_far + stage_seconds(problem, stage)
                if nxt not in best or total < best[nxt][0] - 1e-15:
                    best[nxt] = (total, state, stage)
                    level = levels.setdefault(len(nxt), set())
                    level.add(nxt)
                    if len(level) > 16 * beam:  # keep memory bounded: drop the costliest
                        _prune(level, best, 4 * beam)
    stages = []
    state = frozenset(range(problem.n))
    while state:
        _, before, stage = best[state]
        stages.append(stage)
        state = before
    stages.reverse()
    return stages


def _prune(level: set[frozenset[int]], best: dict, keep: int) -> None:
    """Keep the `keep` cheapest states of a level not yet extended; forget the others."""
    ranked = sorted(level, key=lambda state: best[state][0])
    for state in ranked[keep:]:
        level.discard(state)
        del best[state]


def _successors(problem: Problem) -> list[list[int]]:
    succs: list[list[int]] = [[] for _ in range(problem.n)]
    for i, ps in enumerate(problem.preds):
        for p in ps:
            succs[p].append(i)
    return succs


def _endings(problem: Problem, state: frozenset[int], limit: int, max_groups: int,
             width: int = 6, most: int = 64) -> list[tuple[frozenset[int], list[frozenset[int]]]]:
    """The stages worth trying next: one ready step alone, or 2..max_groups independent
    chains of at most `limit` steps together, every step's predecessors in `state` or
    before it in its chain. (Several steps merged into one group cost what they cost one
    stage after another, so single steps cover those.) Bounded as IOS bounds its search:
    chains start from the `width` costliest ready steps (a cheap step gains little from
    company) and grow by their successors, and at most `most` endings of two steps or
    more are tried besides the single steps."""
    low = min((i for i in range(problem.n) if i not in state), default=problem.n)
    ready = [i for i in range(low, problem.n) if i not in state and problem.preds[i] <= state]
    found: dict[frozenset[int], list[frozenset[int]]] = {
        frozenset({i}): [frozenset({i})] for i in ready}
    seeds = sorted(ready, key=lambda i: -problem.seconds(i, problem.cores))[:width]
    succs = problem.successors
    grow = [frozenset({i}) for i in seeds]
    grown = 0  # endings of two steps or more (single steps are always tried)
    while grow and grown < most:
        current = grow.pop()
        if len(current) == limit:
            continue
        have = state | current
        for i in sorted(set(seeds).union(*(succs[j] for j in current))):
            if i in have or not problem.preds[i] <= have:
                continue
            bigger = current | {i}
            if bigger in found:
                continue
            # i joins the pieces holding its predecessors (nothing in the block follows i)
            pieces = [p for p in found[current] if not p & problem.preds[i]]
            pieces.append(frozenset({i}).union(*(p for p in found[current]
                                                 if p & problem.preds[i])))
            if len(pieces) <= max_groups:
                found[bigger] = pieces
                grow.append(bigger)
                grown += 1
    return [(t, pieces) for t, pieces in found.items() if len(t) == 1 or len(pieces) > 1]


def _stage(problem: Problem, block: frozenset[int], pieces: list[frozenset[int]]) -> Stage:
    """A single step with every core, or the block's independent chains (`pieces`) side by
    side (merged into one group where two of them may not run at once)."""
    pieces = sorted(pieces, key=min)
    if len(pieces) == 1 or any(problem.exclusive(i, j) for a, pa in enumerate(pieces)
                               for pb in pieces[a + 1:] for i in pa for j in pb):
        return Stage((tuple(sorted(block)),), (problem.cores,))
    share = problem.share(len(pieces))
    return Stage(tuple(tuple(sorted(p)) for p in pieces), (share,) * len(pieces))
