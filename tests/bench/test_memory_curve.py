"""`opweave bench --memory` (bench/memory_curve.py): each configuration in a process of its
own, and a refused budget measured at the smallest peak instead."""
from __future__ import annotations

from opweave.bench import memory_curve


def test_configurations_run_in_fresh_processes_down_to_the_smallest_budget(monkeypatch, capsys):
    def not_here(*args, **kwargs):
        raise AssertionError("a configuration was built in the parent process")

    # the children import their own memory_curve: this patch is not theirs
    monkeypatch.setattr(memory_curve, "build", not_here)
    monkeypatch.setattr(memory_curve, "configurations",
                        lambda fractions: [("eager", None), ("opweave budget 1%", 0.01)])
    rows = memory_curve.measure("xmlcnn", 2, [0.01], runs=1, small=True, threads=1)
    eager, smallest = rows
    assert eager.config == "eager" and eager.predicted is None
    assert smallest.config.endswith("(smallest)"), smallest.config
    assert "cannot be met" in capsys.readouterr().out
    for row in rows:
        assert row.seconds > 0 and row.allocated > 0 and row.rss > 0
    assert smallest.predicted > 0
    assert "| xmlcnn | opweave budget" in memory_curve.table(rows)
