"""`opweave bench --schedules`: three schedules of one model's measured steps, each run on
the compiled model and timed; their outputs must be the sequential plan's."""
from __future__ import annotations

from opweave.bench import stages


def test_each_schedule_runs_the_model_and_computes_what_the_sequential_plan_does():
    row = stages.measure("zoo-inception", small=True, rounds=1, warmup=0)
    assert set(row.ms) == set(stages.SCHEDULES) and all(v > 0 for v in row.ms.values())
    assert row.steps > 10 and row.eager_ms > 0
    assert row.concurrent["sequential"] == 0
    assert all(v > 0 for v in row.estimate_ms.values())  # (their order: test_stages.py)
    assert max(row.max_diff.values()) < 1e-4
    text = stages.table([row])
    assert text.splitlines()[0] == stages.HEADER.splitlines()[0]
    assert text.splitlines()[-1].startswith("| zoo-inception | ")
