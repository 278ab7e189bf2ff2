"""Recompute at the peak: a greedy planner over exact liveness.

While the order's peak is over the budget: at the peak's position, every storage alive
there that no step at that position reads is a candidate; recomputing its step (and the
views of it that are read later) just before its next read frees it in between. Each of
the largest candidates is tried on the exact liveness (`live_bytes`), and the one that
lowers the peak position's bytes most per second of recomputation, without raising the
overall peak, is taken. A recomputation's inputs live longer; when that makes one of
them the problem, it becomes a candidate at a later peak, so chains recompute too.

It is the fast path for graphs whose Checkmate program is too large for the MILP, and
the incumbent the MILP's answer must beat; its lowest peak is where the search for the
smallest feasible peak starts (`smallest_peak`).
"""
from __future__ import annotations

from .problem import Problem, live_bytes, validate

CANDIDATES = 12        # candidates tried per move (largest first)


def recompute_at_peaks(problem: Problem, order: list[int], budget: int) -> list[int]:
    """The order after greedy recomputations: under `budget` if it got there, else the
    lowest peak it reached (the caller compares)."""
    current, profile = list(order), live_bytes(problem, order)
    best, best_peak = current, max(profile, default=0)
    for _ in range(4 * problem.n + 16):
        if best_peak <= budget:
            break
        move = _best_move(problem, current, profile, profile.index(max(profile)))
        if move is None:
            break
        current, profile = move
        if max(profile) < best_peak:
            best, best_peak = current, max(profile)
    return best


def _best_move(problem: Problem, order: list[int], profile: list[int], position: int):
    peak = profile[position]
    best, best_score = None, 0.0
    for chain, at, nbytes in sorted(_candidates(problem, order, position),
                                    key=lambda c: -c[2])[:CANDIDATES]:
        new = order[:at] + chain + order[at:]
        try:
            validate(problem, new)
        except AssertionError:
            continue
        new_profile = live_bytes(problem, new)
        gain = peak - new_profile[position]
        if gain <= 0 or max(new_profile) > peak:
            continue
        seconds = sum(problem.facts[i].seconds for i in chain)
        score = gain / max(seconds, 1e-9)
        if score > best_score:
            best, best_score = (new, new_profile), score
    return best


def _candidates(problem: Problem, order: list[int], position: int):
    """(steps to run again, where, bytes freed) for each recomputable storage alive at
    `position` and not read there."""
    facts, storage = problem.facts, problem.storage
    owner_step: dict = {}   # storage owner value -> the step making it
    written: dict = {}      # value -> position of its latest write before `position`
    read_here: set = set()
    for pos in range(position + 1):
        step = problem.steps[order[pos]]
        if pos == position:
            read_here = {storage.get(v) for v in step.inputs} | \
                {storage.get(v) for v in step.outputs}
        for v in step.outputs:
            written[v] = pos
            if storage.get(v) is v:
                owner_step[v] = order[pos]
    next_read: dict = {}    # value -> its first read after `position` (before a rewrite)
    rewritten: set = set()
    for pos in range(position + 1, len(order)):
        step = problem.steps[order[pos]]
        for v in step.inputs:
            if v in written and v not in rewritten and v not in next_read:
                next_read[v] = pos
        rewritten.update(step.outputs)
    by_owner: dict = {}
    for v, pos in next_read.items():
        owner = storage.get(v)
        if owner is None or owner in read_here or owner in problem.graph_outputs:
            continue
        by_owner.setdefault(owner, []).append(v)
    found = []
    for owner, values in by_owner.items():
        steps = sorted({order[written[v]] for v in values} | {owner_step[owner]})
        if not all(facts[i].recomputable for i in steps):
            continue
        found.append((steps, min(next_read[v] for v in values), owner.type.nbytes))
    return found

