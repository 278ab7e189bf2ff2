"""Distributed tuning: `opweave tune MODEL --ray` runs trials as Ray tasks on a local
cluster (two workers here), each still in a worker process of its own, and records what
they measured under the target they measured it on."""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from opweave.autotune import search  # noqa: E402
from opweave.autotune.runners import RayRunner  # noqa: E402
from opweave.tune import configs, open_db  # noqa: E402
from opweave.tune.target import describe, target_id  # noqa: E402


def test_trials_run_as_ray_tasks_on_a_local_cluster(tmp_path):
    db = open_db(tmp_path / "t.sqlite")
    runner = RayRunner(None, workers=2, threads=1)
    try:
        assert runner.slots == 2 and ray.is_initialized()
        lines = []
        result = search.tune_model("xmlcnn", db, small=True, trials=3, threads=1, rounds=2,
                                   confirm=2, runner=runner, progress=lines.append)
    finally:
        runner.close()
    assert not ray.is_initialized()  # the cluster it started is stopped
    assert "on Ray (a local cluster), 2 worker(s)" in lines[0]
    assert sum(not t.resumed for t in result.trials) == 3
    assert all(t.samples for t in result.trials if not t.error)
    here = target_id(describe(1))
    trials = [r for r in db.records(here) if r.kind == search.TRIAL_KIND]
    assert len(trials) == 3
    (key,) = {tuple(k) for k in result.baseline.graph_keys}
    record = db.get(configs.KIND, key[0], here)
    assert record is not None and record.config == result.best.config
