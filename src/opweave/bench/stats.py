"""Statistics of timing samples: summaries, pairwise ratios and geometric means."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Summary:
    """Median, min and max of one backend's samples (seconds)."""

    median: float
    min: float
    max: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Summary":
        if not samples:
            raise ValueError("no samples to summarize")
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


def ratio_matrix(medians: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """`ratios[a][b]` = median(b) / median(a): how many times faster `a` ran than `b`
    (above 1: `a` is faster). Only backends measured in the same run belong together."""
    return {a: {b: medians[b] / medians[a] for b in medians} for a in medians}


def geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        return math.nan
    if any(v <= 0 for v in values):
        raise ValueError("geometric mean needs positive values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def round_robin(counts: Mapping[str, int]) -> list[list[str]]:
    """The run order for `counts[name]` runs of each name: rounds in which every name with
    runs left runs once, the order rotating each round (A B C, B C A, C A B, ...), so that
    drift hits all alike and no one always runs right after the same neighbour."""
    rounds = []
    for r in range(max(counts.values(), default=0)):
        active = [name for name, count in counts.items() if count > r]
        shift = r % len(active)
        rounds.append(active[shift:] + active[:shift])
    return rounds


def runs_within_budget(seconds_per_call: float, runs: int, budget_s: float) -> int:
    """How many of `runs` fit in `budget_s`: at least 3 (a median), unless not even 3 fit,
    where a single run has to do (a backend that slow is reported with its run count)."""
    if seconds_per_call <= 0:
        return runs
    fit = int(budget_s / seconds_per_call)
    return min(runs, fit) if fit >= 3 else min(runs, 1)
