"""Segment checkpointing: keep what crosses chosen cuts of the forward, recompute the rest
of each segment once, just before the backward first reads it.

This is what `torch.utils.checkpoint` on every transformer block does by hand (and Chen et
al.'s sqrt(n) checkpointing in general), found from the steps: a cut is a position of the
forward crossed by few bytes (a block boundary, where the residual stream is all that
flows on). The MILP (`milp.py`) cannot reach these plans on large graphs: its stages are
coarse and its node limit stops it; the greedy planner recomputes one storage at a time
and stops where each single move raises the peak. Every k-th cut gives one candidate
order; `plan` weighs them with the others by their exact peak and modelled time.
"""
from __future__ import annotations

from .problem import Problem, live_bytes, validate

CUT_SLACK = 1.5  # a cut is crossed by at most this times the median local minimum


def forward_end(problem: Problem) -> int:
    """The position of the unconstrained order's peak: in a training step every value the
    backward reads from the forward is alive there, so the steps up to it are the forward
    (and at most a few backward steps, which then just join the last segment)."""
    profile = live_bytes(problem, range(problem.n))
    return profile.index(max(profile)) if profile else 0


def _producers(problem: Problem) -> dict:
    return {v: i for i, step in enumerate(problem.steps) for v in step.outputs}


def _last_forward_reads(problem: Problem, end: int) -> list[int]:
    """For each step, the last position up to `end` reading its outputs (-1: none)."""
    last = [-1] * problem.n
    for p in range(min(end, problem.n - 1) + 1):
        for r in problem.facts[p].reads:
            last[r] = max(last[r], p)
    return last


def crossing_bytes(problem: Problem, end: int) -> list[int]:
    """For each position c up to `end`: bytes of the storages made before c that the
    forward reads at c or later (what a cut at c must keep)."""
    producer = _producers(problem)
    last = _last_forward_reads(problem, end)
    span: dict[int, int] = {}  # owner step -> last forward read of any value on its storage
    for i, step in enumerate(problem.steps[:end + 1]):
        for v in step.outputs:
            owner = problem.storage.get(v)
            if owner is not None and owner in producer:
                o = producer[owner]
                span[o] = max(span.get(o, -1), last[i])
    delta = [0] * (end + 2)
    for o, until in span.items():
        if until > o and problem.facts[o].owned:
            delta[o + 1] += problem.facts[o].owned
            delta[until + 1] -= problem.facts[o].owned
    profile, running = [], 0
    for c in range(end + 1):
        running += delta[c]
        profile.append(running)
    return profile


def candidate_cuts(problem: Problem, end: int) -> list[int]:
    """Positions to cut the forward at: the first position of each run of equally crossed
    positions that both neighbouring runs exceed (a local minimum of `crossing_bytes`),
    when it is crossed by at most `CUT_SLACK` times the median of those minima. The median,
    not the least: a few bytes (a mask) may cross every position of the forward, and the
    embedding's positions may be crossed by less than a block boundary is."""
    cross = crossing_bytes(problem, end)
    runs = []  # (first position, bytes) of each run of equal crossing
    for c in range(1, end + 1):
        if not runs or cross[c] != runs[-1][1]:
            runs.append((c, cross[c]))
    minima = [runs[k] for k in range(1, len(runs) - 1)
              if runs[k - 1][1] > runs[k][1] < runs[k + 1][1]]
    if not minima:
        return []
    median = sorted(b for _, b in minima)[len(minima) // 2]
    return [c for c, b in minima if b <= CUT_SLACK * median]


def segment_order(problem: Problem, end: int, cuts: list[int]) -> list[int]:
    """The forward as it is, then the backward with each forward step it reads recomputed
    just before the first such read, unless the step is kept: it makes a value crossing a
    cut (with the storage it views), cannot be recomputed, or is past `end`."""
    facts = problem.facts
    last = _last_forward_reads(problem, end)
    producer = _producers(problem)
    kept = {i for i in range(problem.n) if i > end or not facts[i].recomputable}
    kept |= {i for c in cuts for i in range(c) if last[i] >= c}
    for i in [i for i in kept if i <= end]:  # with the storage a kept view views
        for v in problem.steps[i].outputs:
            owner = problem.storage.get(v)
            if owner is not None and owner in producer:
                kept.add(producer[owner])
    order = list(range(end + 1))
    fresh: set[int] = set()

    def ensure(i: int) -> None:  # iterative: a segment's chain of reads may be long
        todo = [(i, False)]
        while todo:
            j, ready = todo.pop()
            if j in kept or j in fresh:
                continue
            if ready:
                order.append(j)
                fresh.add(j)
                continue
            todo.append((j, True))
            todo.extend((r, False) for r in reversed(facts[j].reads))

    for p in range(end + 1, problem.n):
        for r in facts[p].reads:
            ensure(r)
        order.append(p)
        spoiled = facts[p].overwrites  # a later read needs it made again
        if spoiled is not None and spoiled <= end and facts[spoiled].recomputable:
            fresh.discard(spoiled)
            kept.discard(spoiled)
    return order


def orders(problem: Problem) -> list[list[int]]:
    """The order with every k-th candidate cut kept, for each k up to their count; an
    order that reads a value an in-place step spoiled first is left out."""
    end = forward_end(problem)
    cuts = candidate_cuts(problem, end)
    found = []
    for k in range(1, len(cuts) + 1):
        order = segment_order(problem, end, cuts[k - 1::k])
        try:
            validate(problem, order)
        except AssertionError:
            continue
        found.append(order)
    return found
