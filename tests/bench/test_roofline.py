"""The GEMM-peak cache of the roofline: miss, hit, corrupted entry; and model FLOPs."""
from __future__ import annotations

import json

import pytest

from opweave.bench import roofline

from ..conftest import small_model


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    return tmp_path / roofline.CACHE_FILE


def test_peak_is_measured_once_then_cached(cache):
    calls = []
    measure = lambda: calls.append(1) or 123e9
    assert roofline.gemm_peak(2, measure) == (123e9, False)
    assert roofline.gemm_peak(2, measure) == (123e9, True)
    assert roofline.gemm_peak(1, measure) == (123e9, False)  # another thread count: new entry
    assert len(calls) == 2
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", None])
def test_corrupted_cache_is_reported_and_replaced(cache, content):
    if content is None:  # a well-formed file with a nonsense entry
        content = json.dumps({roofline.calibration_key(2): -5})
    cache.write_text(content)
    with pytest.warns(UserWarning, match="corrupted GEMM-peak cache"):
        assert roofline.gemm_peak(2, lambda: 50e9) == (50e9, False)
    assert json.loads(cache.read_text()) == {roofline.calibration_key(2): 50e9}
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no temp file left


def test_measured_peak_is_plausible():
    flops = roofline.measure_gemm_peak(sizes=(256,), seconds_per_size=0.05)
    assert 1e8 < flops < 1e13


def test_model_flops_from_ir_cost_formulas():
    bench = small_model("xmlcnn")
    infer = roofline.model_flops(bench, "infer")
    train = roofline.model_flops(bench, "train")
    # the three convolutions alone: 2 * out_len * filters * embed * width each
    seq, embed, filters = bench.inputs[0].shape[1], 32, 8
    convs = sum(2 * (seq - w + 1) * filters * embed * w for w in (2, 4, 8))
    assert infer > convs
    assert 2 * infer < train < 4 * infer  # backward costs about twice the forward
