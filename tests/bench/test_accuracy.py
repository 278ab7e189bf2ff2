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


def test_bf16_error_is_bf16s_and_float32s_is_float32s(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")  # the library forms, whichever is faster here
    errors = {e.mode: e for e in accuracy.measure(small_model("bert-base"))}
    assert set(errors) == {"eager fp32", "opweave fp32", "opweave bf16"}
    assert errors["eager fp32"].rel_l2 < 1e-5
    assert errors["opweave fp32"].rel_l2 < 1e-5
    assert 1e-4 < errors["opweave bf16"].rel_l2 < 2e-2
    assert "opweave bf16" in accuracy.table(list(errors.values()))
