"""Attention's measured form (codegen/attention.py): the unfused form against the fused
kernel, where it is offered, and the choice's record."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave
from opweave import Options, tune
from opweave.codegen import attention
from opweave.ir import Graph, TensorType
from opweave.ir.ops.linalg import _attention


def _heads(b, s, h, d):
    return torch.randn(b, s, h, d).transpose(1, 2)      # as models split heads


@pytest.mark.parametrize("batch, lq, lk", [(1, 7, 7), (2, 5, 9), (1, 33, 17)])
@pytest.mark.parametrize("mask", [None, "keys", "per batch", "full"])
@pytest.mark.parametrize("scale", [0.125, -0.5])
def test_the_unfused_form_matches_the_fused_kernel(batch, lq, lk, mask, scale):
    torch.manual_seed(0)
    q, k, v = _heads(batch, lq, 3, 8), _heads(batch, lk, 3, 8), _heads(batch, lk, 3, 8)
    shapes = {None: None, "keys": (lk,), "per batch": (batch, 1, 1, lk),
              "full": (batch, 3, lq, lk)}
    additive = None if mask is None else torch.randn(shapes[mask])
    if additive is not None:
        additive[..., 0] = float("-inf")                # a masked key
        if mask == "full":
            additive[0, 1, 2] = float("-inf")          # a row hidden entirely: 0, not NaN
        elif batch == 2 and mask == "per batch":
            additive[1] = float("-inf")                # a sequence hidden entirely
    want = _attention(q, k, v, additive, scale=scale, causal=False)
    got = attention.unfused(q, k, v, additive, scale=scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # laid out as the kernel's result: merging the heads afterwards copies nothing
    assert got.stride() == want.stride()


def _node(causal=False, mask_dtype=None, seq=16, heads=2):
    g = Graph("attn")
    q, k, v = (g.add_input(n, TensorType((1, heads, seq, 8), torch.float32)) for n in "qkv")
    ins = [q, k, v]
    if mask_dtype is not None:
        ins.append(g.add_input("mask", TensorType((1, 1, 1, seq), mask_dtype)))
    out = g.add1("attention", ins, {"scale": 0.3, "causal": causal})
    g.outputs = [out]
    return g, out.producer


def test_it_is_offered_without_causal_or_boolean_masks_or_huge_scores():
    assert attention.applies(_node()[1])
    assert attention.applies(_node(mask_dtype=torch.float32)[1])
    assert not attention.applies(_node(causal=True)[1])
    assert not attention.applies(_node(mask_dtype=torch.bool)[1])
    seq = 2048                                           # 2 heads x 2048^2 x 4 bytes = 32 MiB
    assert not attention.applies(_node(seq=seq)[1])


def test_the_choice_is_measured_once_and_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(attention, "_CHOICES", {})      # as in a new process
    db = tune.open_db(str(tmp_path / "tuning.sqlite"))
    _, node = _node(mask_dtype=torch.float32)
    chosen = attention.choose(node, db)
    assert chosen in attention.FORMS
    (record,) = [r for r in db.records() if r.kind == attention.KIND]
    assert record.config["form"] == chosen and set(record.samples) == {"fused", "unfused"}
    # a second process reads it back: nothing is measured again
    monkeypatch.setattr(attention, "_CHOICES", {})
    measured = []
    original = attention.choice.measure
    try:
        attention.choice.measure = lambda *a, **k: measured.append(1) or original(*a, **k)
        assert attention.choose(node, db) == chosen
    finally:
        attention.choice.measure = original
    assert not measured


def test_a_recheck_measures_a_recorded_choice_again(tmp_path, monkeypatch):
    """`opweave tune --recheck`: the record's samples and the new ones decide together."""
    monkeypatch.setattr(attention, "_CHOICES", {})
    db = tune.open_db(str(tmp_path / "tuning.sqlite"))
    _, node = _node(mask_dtype=torch.float32)
    key = attention._key(node, attention.Mask(node, None))
    # a record made under load: the unfused form once measured 1 us
    tune.remember(attention.KIND, key, "unfused", {"fused": [1.0], "unfused": [1e-6]}, db)
    with attention.choice.rechecking():
        assert attention.choose(node, db, rounds=3) == "unfused"   # its 1 us still counts
    (record,) = [r for r in db.records() if r.kind == attention.KIND]
    assert len(record.samples["unfused"]) == 4 and len(record.samples["fused"]) == 4
    monkeypatch.setattr(attention, "_CHOICES", {})
    tune.remember(attention.KIND, key, "unfused", {"fused": [1e-6], "unfused": [1.0]}, db)
    assert attention.choose(node, db) == "unfused"                 # recalled, not measured
    with attention.choice.rechecking():
        monkeypatch.setattr(attention, "_CHOICES", {})
        assert attention.choose(node, db, rounds=3) == "fused"     # measured again


class _Block(nn.Module):
    """Self-attention with an additive mask, as BERT calls it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 32)


@pytest.mark.parametrize("form", ["fused", "unfused", None])
def test_a_model_runs_the_chosen_form_and_the_native_plan_replays_it(form, monkeypatch):
    """None: unmeasured (measure=False), the op's own form."""
    if form is not None:
        monkeypatch.setattr(attention, "choose", lambda node, db=None, mask=None: form)
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(2, 12, 32)
    mask = torch.zeros(2, 1, 1, 12)
    mask[1, ..., -3:] = float("-inf")                  # padding in the second sequence
    compiled = opweave.compile(model, (x, mask), options=Options(
        measure=form is not None, deterministic=True, tuning_db=None, native="wait"))
    executor = compiled.program.compiled_graphs[0].executor
    names = [s.name for s in executor.lowered_steps if s.nodes[0].op == "attention"]
    assert names == ["attention" if form is None else f"attention ({form})"]
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(2, 12, 32), mask)
        assert executor.native.plan is not None, executor.native.describe()
        x = torch.randn(2, 12, 32)
        torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=1e-5, rtol=1e-5)


def test_what_a_constant_mask_tells():
    _, node = _node(mask_dtype=torch.float32)
    runtime = attention.Mask(node, None)
    assert not runtime.dropped and runtime.hidden_rows
    assert attention.Mask(node, torch.zeros(1, 1, 1, 16)).dropped
    keys = torch.zeros(1, 1, 1, 16)
    keys[..., 3] = float("-inf")
    assert not attention.Mask(node, keys).hidden_rows           # a key, not a whole row
    keys[...] = float("-inf")
    assert attention.Mask(node, keys).hidden_rows
    assert attention.Mask(_node()[1], None).dropped             # no mask at all


class _ZeroMasked(nn.Module):
    """Attention given a mask of zeros built inside the model (what ViT's export leaves)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = torch.zeros(1, 1, s, s)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 32)


def test_a_constant_mask_of_zeros_is_not_read():
    torch.manual_seed(0)
    model, x = _ZeroMasked().eval(), torch.randn(1, 10, 32)
    compiled = opweave.compile(model, (x,), options=Options(deterministic=True,
                                                             tuning_db=None))
    (step,) = [s for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps
               if s.nodes[0].op == "attention"]
    assert len(step.inputs) == 3 and len(step.nodes[0].inputs) == 4
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_choice_is_kept_for_the_process(monkeypatch):
    monkeypatch.setattr(attention, "_CHOICES", {})
    _, node = _node(mask_dtype=torch.float32, seq=24)
    first = attention.choose(node)               # no database: measured, then memoized
    original = attention.choice.measure
    try:
        attention.choice.measure = lambda *a, **k: pytest.fail("measured again")
        assert attention.choose(node) == first
    finally:
        attention.choice.measure = original
