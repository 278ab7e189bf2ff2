"""Statistics and run ordering of the benchmark harness."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from opweave.bench.stats import (Summary, geometric_mean, median_interval, ratio_matrix,
                                 round_robin, runs_within_budget, williams_square)


def test_summary_median_min_max():
    s = Summary.of([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max, s.count) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        Summary.of([])


def test_ratio_matrix_reads_as_row_speedup_over_column():
    ratios = ratio_matrix({"eager": 0.2, "fast": 0.1})
    assert ratios["fast"]["eager"] == pytest.approx(2.0)  # fast is 2x faster than eager
    assert ratios["eager"]["fast"] == pytest.approx(0.5)
    assert ratios["eager"]["eager"] == 1.0


def test_geometric_mean():
    assert geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(geometric_mean([]))
    with pytest.raises(ValueError):
        geometric_mean([1.0, 0.0])


def test_round_robin_balances_who_runs_after_whom_and_runs_each_its_count():
    for n in range(1, 8):
        names = "abcdefg"[:n]
        square = williams_square(n)
        rounds = round_robin({name: len(square) for name in names})
        assert [sorted(r) for r in rounds] == [sorted(names)] * len(square)
        after = Counter((r[i], r[i + 1]) for r in rounds for i in range(n - 1))
        if n > 1:  # every ordered pair equally often
            assert len(after) == n * (n - 1) and len(set(after.values())) == 1, after
        positions = Counter((name, r.index(name)) for r in rounds for name in names)
        assert len(set(positions.values())) == 1  # every name in every position alike
    rounds = round_robin({"a": 4, "b": 2, "c": 4})
    flat = [name for r in rounds for name in r]
    assert {n: flat.count(n) for n in "abc"} == {"a": 4, "b": 2, "c": 4}
    assert all(len(set(r)) == len(r) for r in rounds)  # one call per backend per round
    assert round_robin({}) == []


def test_runs_within_budget():
    assert runs_within_budget(0.01, runs=10, budget_s=60) == 10
    assert runs_within_budget(10.0, runs=10, budget_s=60) == 6
    assert runs_within_budget(20.0, runs=10, budget_s=60) == 3  # still a median of 3
    assert runs_within_budget(25.0, runs=10, budget_s=60) == 1  # too slow for 3: one run
    assert runs_within_budget(1.0, runs=2, budget_s=60) == 2


def test_the_median_interval_is_between_order_statistics_of_binomial_coverage():
    assert median_interval(range(1, 21)) == (10.5, 6, 15, pytest.approx(0.95861, abs=1e-5))
    assert median_interval(range(1, 11))[1:3] == (2, 9)
    # too few values for 95%: the whole range, and the coverage it has
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, 1.0, 5.0, 0.9375)
    assert median_interval([7.0]) == (7.0, 7.0, 7.0, 0.0)
    with pytest.raises(ValueError):
        median_interval([])
