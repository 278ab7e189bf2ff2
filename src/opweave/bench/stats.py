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
    runs left runs once, in the orders of a Williams square (Williams 1949), so that over
    each square every name runs right after every other name equally often, and in every
    position equally often. A name's time depends on what ran before it (its data left
    in the caches, or evicted by a large neighbour), and rotating one order (A B C, B C A,
    C A B) keeps each name after the same neighbour in nearly every round: two identical
    compiles of XML-CNN in bf16, called in one process after a float32 compile in such
    rotations, measured 0.576 and 0.536 ms (the one after the float32 model slower), and
    0.524 and 0.517 called in random orders."""
    names = list(counts)
    square = williams_square(len(names))
    rounds = []
    for r in range(max(counts.values(), default=0)):
        order = [names[i] for i in square[r % len(square)]]
        rounds.append([name for name in order if counts[name] > r])
    return rounds


def williams_square(n: int) -> list[list[int]]:
    """Orders of 0..n-1 in which each ordered pair of neighbours occurs equally often and
    each index takes each position equally often: n orders for an even n, 2n for an odd
    one (each order and its reverse)."""
    if n == 0:
        return [[]]
    first = [(j + 1) // 2 if j % 2 else (n - j // 2) % n for j in range(n)]
    rows = [[(i + shift) % n for i in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def runs_within_budget(seconds_per_call: float, runs: int, budget_s: float) -> int:
    """How many of `runs` fit in `budget_s`: at least 3 (a median), unless not even 3 fit,
    where a single run has to do (a backend that slow is reported with its run count)."""
    if seconds_per_call <= 0:
        return runs
    fit = int(budget_s / seconds_per_call)
    return min(runs, fit) if fit >= 3 else min(runs, 1)


def median_interval(values: Sequence[float], confidence: float = 0.95
                    ) -> tuple[float, float, float, float]:
    """(median, low, high, coverage): the median of `values` and a distribution-free
    confidence interval for the median of what they were drawn from, between two order
    statistics, the k-th smallest and the k-th largest: the widest k whose interval covers
    the true median with probability at least `confidence` (each value falls below it with
    probability 1/2, so the count below is binomial(n, 1/2)), and `coverage` that
    probability. Timing noise is skewed and comes in phases, so no normal approximation;
    with too few values for `confidence` the interval is the whole range, and `coverage`
    says how much less it holds (5 values: 94%; 20: the 6th to the 15th, 96%)."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        raise ValueError("no values for a median interval")
    def coverage(k: int) -> float:  # 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return statistics.median(ordered), ordered[k - 1], ordered[n - k], coverage(k)
