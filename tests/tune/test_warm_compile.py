"""Compiling with the tuning database: a warm compile looks every choice up, measures
nothing, and gives the same plan; without a database every choice is measured."""
from __future__ import annotations

import pytest
import torch

import opweave
from opweave.codegen import choice, gemm
from opweave.options import Options
from opweave.partition import clear_cache


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc1, self.fc2 = torch.nn.Linear(8 * 6 * 6, 32), torch.nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _forget_process_memos():
    choice._CHOICES.clear()
    choice._CLASS_CHOICES.clear()
    gemm._CHOICES.clear()
    clear_cache()


def _plan(compiled) -> list[tuple[str, str]]:
    steps = compiled.program.steps[0].executor.lowered_steps
    return [(s.kind, s.name) for s in steps]


def test_a_warm_compile_measures_nothing_and_gives_the_same_plan(tmp_path, monkeypatch):
    model, x = Net().eval(), torch.randn(1, 3, 6, 6)
    options = Options(tuning_db=str(tmp_path / "tuning.sqlite"))
    _forget_process_memos()
    measured = []
    real = choice.measure
    monkeypatch.setattr(choice, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    cold = opweave.compile(model, (x,), options=options)
    assert measured, "a cold compile measures its library choices"
    _forget_process_memos()

    def refuse(*args, **kwargs):
        raise AssertionError("a warm compile measured something")
    monkeypatch.setattr(choice, "measure", refuse)
    warm = opweave.compile(model, (x,), options=options)
    assert _plan(warm) == _plan(cold)
    with torch.no_grad():
        torch.testing.assert_close(warm(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_recheck_measures_recorded_forms_again_and_decides_on_every_sample(tmp_path):
    """Records taken as if under heavy load (every form 1 s, the reference chosen) are
    measured again under `recheck`: each keeps its old samples, gains new ones, and is
    decided on all of them, so the inflated times no longer choose."""
    from opweave import tune
    from opweave.tune.db import Record

    model, x = Net().eval(), torch.randn(1, 3, 6, 6)
    path = str(tmp_path / "tuning.sqlite")
    _forget_process_memos()
    opweave.compile(model, (x,), options=Options(tuning_db=path))
    db = tune.open_db(path)
    records = [r for r in db.records() if r.kind == choice.KIND]
    assert records
    for r in records:
        loaded = {form: [1.0] * len(times) for form, times in r.samples.items()}
        db.put(Record(r.kind, r.workload, r.target, r.workload_text,
                      {**r.config, "form": "reference"}, 1.0, loaded))
    _forget_process_memos()
    rechecked = opweave.compile(model, (x,), options=Options(tuning_db=path, recheck=True))
    for r in records:
        again = db.get(r.kind, r.workload, r.target)
        for form, times in again.samples.items():
            old = len(r.samples[form])
            assert times[:old] == [1.0] * old and len(times) > old
        assert again.seconds < 1.0
        # the decision rule on all the samples (the fastest, or the direct form within 3%)
        assert again.config["form"] == choice._preferring_direct(again.samples)
    with torch.no_grad():
        torch.testing.assert_close(rechecked(x), model(x), rtol=1e-4, atol=1e-5)


def test_without_a_database_choices_are_measured_every_process(tmp_path, monkeypatch):
    model, x = Net().eval(), torch.randn(1, 3, 6, 6)
    options = Options(tuning_db=None)
    for _ in range(2):
        _forget_process_memos()
        measured = []
        real = choice.measure
        monkeypatch.setattr(choice, "measure",
                            lambda *a, real=real, **k: measured.append(1) or real(*a, **k))
        opweave.compile(model, (x,), options=options)
        assert measured
        monkeypatch.undo()


def test_the_training_gemm_form_is_recorded_at_its_first_call(tmp_path):
    from opweave import tune

    db = tune.open_db(tmp_path / "tuning.sqlite")
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    gemm._CHOICES.clear()
    torch.testing.assert_close(gemm.measured_matmul(a, b, db), a @ b, rtol=1e-4, atol=1e-4)
    (record,) = db.records()
    assert record.kind == "gemm-form" and record.config["form"] in ("torch", "onednn")
    assert set(record.samples) == {"torch", "onednn"}
    gemm._CHOICES.clear()
    before = db.records()
    gemm.measured_matmul(a, b, db)
    assert db.records() == before  # recalled, not measured again
