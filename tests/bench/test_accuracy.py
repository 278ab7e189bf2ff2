"""`opweave bench --accuracy`: errors against a float64 reference."""
from __future__ import annotations

import pytest
import torch

from opweave.bench import accuracy

from ..conftest import small_model


def test_error_is_over_all_outputs_together():
    ref = (torch.tensor([3.0, 4.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    got = (torch.tensor([3.0, 4.0]), torch.tensor([0.5]))
    max_abs, rel = accuracy.error(got, ref)
    assert max_abs == pytest.approx(0.5)
    assert rel == pytest.approx(0.5 / 5.0)
    with pytest.raises(ValueError, match="1 floating outputs where the reference has 2"):
        accuracy.error(got[:1], ref)


def test_each_precisions_error_is_its_own(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")  # the library forms, whichever is faster here
    errors = {e.mode: e for e in accuracy.measure(small_model("bert-base"))}
    assert set(errors) == {"eager fp32", "opweave fp32", "opweave bf16", "opweave bf16x3",
                           "opweave int8"}
    assert errors["eager fp32"].rel_l2 < 1e-5
    assert errors["opweave fp32"].rel_l2 < 1e-5
    assert errors["opweave bf16x3"].rel_l2 < 1e-5     # float32's accuracy from bf16 parts
    assert 1e-4 < errors["opweave bf16"].rel_l2 < 2e-2
    assert 1e-4 < errors["opweave int8"].rel_l2 < 1e-1
    assert errors["eager fp32"].cosine == pytest.approx(1.0)
    assert 0.99 < errors["opweave int8"].cosine < 1.0
    table = accuracy.table(list(errors.values()))
    assert "opweave int8" in table and "cos(fp32)" in table


@pytest.mark.parametrize("name", ["bert-base", "resnet50"])  # token ids; an image
def test_int8_calibrates_on_other_batches_like_the_benchmarks(name):
    bench = small_model(name)
    batches = accuracy.other_batches(bench, count=2)
    assert len(batches) == 2 and all(len(b) == len(bench.inputs) for b in batches)
    for batch in batches:
        for x, example in zip(batch, bench.inputs):
            assert x.shape == example.shape and x.dtype == example.dtype
            if x.is_floating_point():
                assert not torch.equal(x, example)
            else:
                assert torch.equal(x, example)  # token ids and masks as they are
