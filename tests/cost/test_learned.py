"""The learned ranker of library forms: features read from real decision keys, and the
held-out scores of a model trained on records with a known winner."""
from __future__ import annotations

import hashlib
import math
import random

import pytest

from opweave.cost import learned
from opweave.tune import REVISIONS, Record

TARGET = {"cpu": "test", "features": ["avx2", "fma"], "cores": 2, "threads": 2}
CONV = ("conv", (("dilation", "[1, 1]"), ("groups", "1"), ("padding", "[1, 1]"),
                 ("stride", "[2, 2]")),
        ("f32[1,64,56,56]", "f32[128,64,3,3]", "f32[128]"), (("add", "[]"), ("relu", "[]")))


def _named(values: tuple) -> dict:
    """Features by name, the log2 sizes back as integers."""
    named = dict(zip(learned.FEATURES, values))
    return {k: round(2 ** v) if k.startswith("log_") else v for k, v in named.items()}


def test_conv_features_are_its_gemm_geometry():
    f = _named(learned.features("library-form", CONV, "onednn", TARGET))
    assert f["op"] == learned._OPS.index("conv") and f[learned.FORM] == learned.FORMS.index("onednn")
    assert (f["log_rows"], f["log_k"], f["log_n"]) == (28 * 28, 64 * 9, 128)
    assert (f["window"], f["stride"], f["groups"]) == (9, 2, 1)
    assert (f["epilogue_ops"], f["epilogue_binary"], f["threads"]) == (2, 1, 2)


def test_batched_matmul_and_gemm_keys():
    key = ("matmul", (), ("f32[2,128,768]", "f32[768,3072]"), ())
    f = _named(learned.features("library-form", key, "reference", TARGET))
    assert (f["log_rows"], f["log_k"], f["log_n"]) == (256, 768, 3072)
    gemm = ((128, 768), (768, 1), (768, 3072), (1, 768), "torch.float32", 1)
    g = _named(learned.features("gemm-form", gemm, "torch", TARGET))
    assert (g["a_transposed"], g["b_transposed"], g["threads"]) == (0, 1, 1)


def test_keys_without_features_are_named():
    with pytest.raises(learned.UnknownWorkload, match="max_pool2d"):
        learned.features("library-form", ("max_pool2d", (), ("f32[1,3,8,8]",), ()), "onednn",
                         TARGET)
    with pytest.raises(learned.UnknownWorkload, match="graph-config"):
        learned.features("graph-config", (), "x", TARGET)
    bf16 = ("matmul", (), ("f32[2,128,768]", "f32[768,3072]"), (), ("precision", "bf16"))
    with pytest.raises(learned.UnknownWorkload, match="precision"):  # not ranked: measured
        learned.features("library-form", bf16, "onednn", TARGET)


def planted_records(n: int, seed: int = 0) -> list[Record]:
    """Matmul decisions where oneDNN wins above about 30 kFLOP (half of them) and the
    reference call below (a fixed cost against a faster GEMM), with 3% noise: a rule the
    ranker must find."""
    rng = random.Random(seed)
    records, seen = [], set()
    while len(records) < n:
        m, k, n_ = (2 ** rng.randint(0, 9) for _ in range(3))
        key = ("matmul", (), (f"f32[{m},{k}]", f"f32[{k},{n_}]"), ())
        text = f"library-form:{key!r}"
        if text in seen:  # one record per workload, as in a database
            continue
        seen.add(text)
        flops = 2 * m * k * n_
        base = {"reference": flops / 20e9 + 1e-6, "onednn": flops / 60e9 + 2e-6}
        samples = {form: [t * (1 + 0.03 * rng.random()) for _ in range(3)]
                   for form, t in base.items()}
        best = min(samples, key=lambda f: min(samples[f]))
        records.append(Record("library-form", hashlib.sha256(text.encode()).hexdigest()[:32],
                              "t0", text, {"form": best, "revision": REVISIONS["library-form"]},
                              min(samples[best]), samples))
    return records


def test_held_out_ranking_finds_the_planted_rule():
    batch = learned.examples(planted_records(300), {"t0": TARGET})
    assert len(batch) == 600
    scores = learned.cross_validate(batch, folds=5)
    assert scores["records"] == 300
    assert scores["top1"] >= 0.9 > scores["baseline_top1"]
    assert scores["slowdown_top1"] < min(scores["baseline_slowdown"], 1.05)
    assert scores["top2"] == 1.0 and scores["slowdown_top2"] == 1.0  # two forms: both measured
    assert scores["kendall_tau"] >= 0.8
    # measuring only the (faster) top form skips the slower: over half the time
    assert 0.5 < scores["time_saved_top1"] < 1 and scores["time_saved_top2"] == 0.0


def test_training_is_deterministic_and_the_text_round_trips():
    batch = learned.examples(planted_records(120), {"t0": TARGET})
    a, b = learned.Ranker.fit(batch), learned.Ranker.fit(batch)
    rows = [e.features for e in batch[:20]]
    assert a.predict(rows) == b.predict(rows)
    again = learned.Ranker.from_text(a.to_text())
    assert all(math.isclose(x, y) for x, y in zip(a.predict(rows), again.predict(rows)))
    with pytest.raises(ValueError, match="LightGBM"):
        learned.Ranker.from_text("not a model")


def test_records_it_cannot_read_are_skipped():
    good = planted_records(3)
    other = Record("graph-config", "w", "t0", "graph-config:()", {}, 1.0, {"a": [1.0], "b": [2.0]})
    one_form = Record("library-form", "x", "t0", good[0].workload_text, {}, 1.0, {"onednn": [1.0]})
    elsewhere = Record("library-form", "y", "t9", good[0].workload_text, {}, 1.0, good[0].samples)
    assert len(learned.examples(good + [other, one_form, elsewhere], {"t0": TARGET})) == 6
