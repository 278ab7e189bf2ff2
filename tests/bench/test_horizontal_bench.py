"""`opweave bench --horizontal`: the three ways of training N instances all run and
give throughputs (their speed is the benchmark's to report, not a test's)."""
from __future__ import annotations

import math

from opweave.bench import horizontal


def test_the_three_ways_of_training_an_array_are_measured():
    (row,) = horizontal.measure("xmlcnn", [2], small=True, steps=1, warmup=1)
    assert row.instances == 2
    for value in (row.fused, row.sequential, row.processes):
        assert math.isfinite(value) and value > 0
    assert "| xmlcnn | 2 |" in horizontal.table([row])
