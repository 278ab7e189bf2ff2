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
    assert len(json.loads(cache.read_text())["entries"]) == 2


def _signed(entries: dict) -> str:
    return json.dumps({"sha256": roofline._digest(entries), "entries": entries})


@pytest.mark.parametrize("content, problem", [
    ("{not json", "Expecting property name"),
    ("[1, 2]", "not a GEMM-peak cache"),
    ("legacy", "not a GEMM-peak cache"),           # the old format: no content hash
    ("negative", "not a finite positive"),
    ("NaN", "holds NaN, not a number"),
    ("Infinity", "holds Infinity, not a number"),
    ("flipped digit", "do not match their recorded sha256"),
])
def test_damaged_cache_is_reported_moved_aside_and_replaced(cache, content, problem):
    key = roofline.calibration_key(2)
    if content == "legacy":
        content = json.dumps({key: 80e9})
    elif content == "negative":
        content = _signed({key: -5.0})
    elif content in ("NaN", "Infinity"):  # what json.dumps writes for nan and inf
        content = _signed({key: 1.0}).replace("1.0", content)
    elif content == "flipped digit":
        content = _signed({key: 81e9}).replace("81", "18")
    cache.write_text(content)
    with pytest.warns(UserWarning, match="corrupted GEMM-peak cache") as caught:
        assert roofline.gemm_peak(2, lambda: 50e9) == (50e9, False)
    (message,) = [str(w.message) for w in caught]
    assert problem in message and str(cache) in message and ".corrupt" in message
    assert json.loads(cache.read_text())["entries"] == {key: 50e9}
    assert roofline.gemm_peak(2, lambda: pytest.fail("cached")) == (50e9, True)
    assert sorted(p.name for p in cache.parent.iterdir()) == [  # no temp file left
        cache.name, cache.name + ".corrupt"]
    assert (cache.parent / (cache.name + ".corrupt")).read_text() == content


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_nonsense_measurement_is_refused_not_cached(cache, bad):
    with pytest.raises(ValueError, match="not a finite positive FLOP/s figure"):
        roofline.gemm_peak(2, lambda: bad)
    assert not cache.exists()


def test_model_flops_from_ir_cost_formulas():
    bench = small_model("xmlcnn")
    infer = roofline.model_flops(bench, "infer")
    train = roofline.model_flops(bench, "train")
    # the three convolutions alone: 2 * out_len * filters * embed * width each
    seq, embed, filters = bench.inputs[0].shape[1], 32, 8
    convs = sum(2 * (seq - w + 1) * filters * embed * w for w in (2, 4, 8))
    assert infer > convs
    assert 2 * infer < train < 4 * infer  # backward costs about twice the forward
