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
    want = _attention(q, k, v, additive, scale=scale, causal=False)
    got = attention.unfused(q, k, v, additive, scale=scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


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


def test_the_choice_is_measured_once_and_recorded(tmp_path):
    db = tune.open_db(str(tmp_path / "tuning.sqlite"))
    _, node = _node(mask_dtype=torch.float32)
    chosen = attention.choose(node, db)
    assert chosen in attention.FORMS
    (record,) = [r for r in db.records() if r.kind == attention.KIND]
    assert record.config["form"] == chosen and set(record.samples) == {"fused", "unfused"}
    # a second compile reads it back: nothing is measured again
    measured = []
    original = attention.library.measure
    try:
        attention.library.measure = lambda *a, **k: measured.append(1) or original(*a, **k)
        assert attention.choose(node, db) == chosen
    finally:
        attention.library.measure = original
    assert not measured


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


@pytest.mark.parametrize("measure", [True, False])
def test_a_model_runs_its_measured_form(measure):
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(2, 12, 32)
    mask = torch.zeros(2, 1, 1, 12)
    mask[1, ..., -3:] = float("-inf")                  # padding in the second sequence
    compiled = opweave.compile(model, (x, mask), options=Options(
        measure=measure, deterministic=True, tuning_db=None))
    names = [s.name for g in compiled.program.compiled_graphs
             for s in g.executor.lowered_steps if s.nodes[0].op == "attention"]
    assert len(names) == 1
    if measure:
        assert names[0] in ("attention (fused)", "attention (unfused)")
    else:
        assert names[0] == "attention"              # the op's own form, unmeasured
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=1e-5, rtol=1e-5)
