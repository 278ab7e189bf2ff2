"""Statistics and run ordering of the benchmark harness."""
from __future__ import annotations

import math

import pytest

from opweave.bench.stats import (Summary, geometric_mean, ratio_matrix, round_robin,
                                 runs_within_budget)


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


def test_round_robin_rotates_and_runs_each_its_count():
    rounds = round_robin({"a": 3, "b": 3, "c": 3})
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    # every backend follows each other one at most once per full rotation
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
