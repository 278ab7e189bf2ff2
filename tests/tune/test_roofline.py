"""The measured roofline in the tuning database: stored per machine and thread count, used
by compiles with that database (and said so in the report), refused when damaged."""
from __future__ import annotations

import dataclasses
import warnings

import torch

import opweave
from opweave import cli, cost, tune
from opweave.cost.model import Machine
from opweave.options import Options
from opweave.tune import TuningDBWarning, roofline
from opweave.tune.target import describe, target_id

from .test_warm_compile import Net, _forget_process_memos

SLOW = Machine(flops=2e9, bandwidth=1e9, launch=2e-5, cache_bytes=1 << 18, cache_bandwidth=8e9)
ABOUT = {"threads": torch.get_num_threads(), "caches": {}}


def test_stored_parameters_round_trip_per_thread_count(tmp_path):
    db = tune.open_db(tmp_path / "t.sqlite")
    assert roofline.load(db) is None
    roofline.store(db, SLOW, ABOUT, 1.0)
    assert roofline.load(db) == SLOW
    roofline.store(db, Machine(), {"threads": ABOUT["threads"] + 1}, 1.0)
    assert roofline.load(db) == SLOW  # another thread count is another target


def test_a_compile_costs_with_the_stored_machine_and_says_so(tmp_path, monkeypatch):
    path = str(tmp_path / "t.sqlite")
    roofline.store(tune.open_db(path), SLOW, ABOUT, 1.0)
    seen = []
    real = cost.model.node_seconds
    monkeypatch.setattr("opweave.passes.rewrite.pipeline.node_seconds",
                        lambda *a, **k: seen.append(cost.active()) or real(*a, **k))
    model, x = Net().eval(), torch.randn(1, 3, 6, 6)
    _forget_process_memos()
    compiled = opweave.compile(model, (x,), options=Options(tuning_db=path))
    (graph,) = compiled.program.compiled_graphs
    assert "measured roofline: 2 GFLOP/s" in graph.report("machine")
    assert seen and all(m == SLOW for m in seen)
    assert cost.active() is cost.CPU  # only for that compile
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    _forget_process_memos()
    plain = opweave.compile(model, (x,), options=Options(tuning_db=None))
    assert plain.program.compiled_graphs[0].report("machine") is None


def test_a_damaged_record_is_reported_and_the_defaults_used(tmp_path):
    db = tune.open_db(tmp_path / "t.sqlite")
    roofline.store(db, SLOW, ABOUT, 1.0)
    record = db.get(roofline.KIND, roofline.WORKLOAD, target_id(describe()))
    bad = dict(dataclasses.asdict(SLOW), flops=-1.0)
    db.put(dataclasses.replace(record, config={"machine": bad}), describe())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert roofline.load(db) is None
    assert any(issubclass(w.category, TuningDBWarning) and "flops" in str(w.message)
               for w in caught)


def test_machine_command_measures_and_stores(tmp_path, capsys, monkeypatch):
    from opweave.cost import machine as measured

    monkeypatch.setattr(measured, "measure", lambda threads=None, quick=False: (SLOW, ABOUT))
    path = str(tmp_path / "t.sqlite")
    assert cli.main(["tune", "machine", "--db", path]) == 0
    assert "fp32 GEMM peak" in capsys.readouterr().out
    assert roofline.load(tune.open_db(path)) == SLOW
