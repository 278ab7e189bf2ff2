"""The learned ranker in the database: `opweave tune ranker` trains and stores it; a compile
then measures only the forms it ranks first; a damaged model is reported and ignored."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import opweave
from opweave import cli, tune
from opweave.codegen import choice
from opweave.options import Options
from opweave.tune import TuningDBWarning, ranking
from opweave.tune.target import describe, target_id

from ..cost.test_learned import TARGET, planted_records
from .test_warm_compile import Net, _forget_process_memos


def _planted_db(path, n=200):
    db = tune.open_db(path)
    for r in planted_records(n):
        db.put(r, TARGET)
    return db


def test_train_stores_a_ranker_that_shortlists_the_winner(tmp_path):
    db = _planted_db(tmp_path / "t.sqlite")
    scores, top_k = ranking.train(db)
    assert top_k == 1 and scores["top1"] >= 0.9
    record = db.get(ranking.KIND, ranking.WORKLOAD, target_id(describe()))
    assert record.config["top_k"] == 1 and record.config["scores"]["records"] == 200
    forms = {"reference": None, "onednn": None}
    big = ("matmul", (), ("f32[512,512]", "f32[512,512]"), ())
    tiny = ("matmul", (), ("f32[1,4]", "f32[4,2]"), ())
    assert list(tune.shortlist("library-form", big, forms, db)) == ["onednn"]
    assert list(tune.shortlist("library-form", tiny, forms, db)) == ["reference"]
    # keys it has no features for, and a lone candidate, are left alone
    pool = ("max_pool2d", (), ("f32[1,3,8,8]",), ())
    assert tune.shortlist("library-form", pool, forms, db) == forms
    assert tune.shortlist("library-form", big, {"onednn": None}, db) == {"onednn": None}


def test_records_of_an_older_revision_of_the_forms_are_not_learned_from(tmp_path):
    db = tune.open_db(tmp_path / "t.sqlite")
    for r in planted_records(200):
        db.put(replace(r, config={"form": r.config["form"]}), TARGET)  # no revision: stale
    with pytest.raises(ValueError, match="holds 0 record"):
        ranking.train(db)


def test_a_compile_with_a_stored_ranker_measures_only_its_top_form(tmp_path, monkeypatch):
    path = tmp_path / "t.sqlite"
    ranking.train(_planted_db(path))
    model, x = Net().eval(), torch.randn(1, 3, 6, 6)
    _forget_process_memos()
    measured = []
    real = choice.measure
    monkeypatch.setattr(choice, "measure",
                        lambda candidates, *a, **k: measured.append(list(candidates))
                        or real(candidates, *a, **k))
    compiled = opweave.compile(model, (x,), options=Options(tuning_db=str(path)))
    assert measured and all(len(names) == 1 for names in measured), measured
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    recorded = [r for r in tune.open_db(path).records(target_id(describe()))
                if r.kind == "library-form"]
    assert recorded and all(len(r.samples) == 1 for r in recorded)
    _forget_process_memos()


def test_a_damaged_stored_ranker_is_reported_and_every_form_measured(tmp_path):
    db = _planted_db(tmp_path / "t.sqlite", n=20)
    ranking.store(db, "not a lightgbm model", 1, {}, 1.0)
    forms = {"reference": None, "onednn": None}
    key = ("matmul", (), ("f32[512,512]", "f32[512,512]"), ())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tune.shortlist("library-form", key, forms, db) == forms
    assert any(issubclass(w.category, TuningDBWarning) and "does not load" in str(w.message)
               for w in caught)
    with pytest.raises(ValueError, match="at least 1"):
        ranking.store(db, "x", 0, {}, 1.0)


def test_ranker_command(tmp_path, capsys):
    few = tmp_path / "few.sqlite"
    _planted_db(few, n=5)
    assert cli.main(["tune", "ranker", "--db", str(few)]) == 2
    assert "10 at least are needed" in capsys.readouterr().err
    path = tmp_path / "t.sqlite"
    _planted_db(path)
    assert cli.main(["tune", "ranker", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "top-1 hit" in out and "Kendall tau" in out and "measure the top 1 form" in out
