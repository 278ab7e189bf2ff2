"""Attention's measured form (codegen/attention.py): the unfused and per-head forms
against the fused kernel, where they are offered, and the choice's record."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import opweave
from opweave import Options, tune
from opweave.codegen import attention, onednn_direct, precision
from opweave.ir import Graph, TensorType
from opweave.ir.ops.linalg import _attention


def _heads(b, s, h, d):
    return torch.randn(b, s, h, d).transpose(1, 2)      # as models split heads


needs_per_head = pytest.mark.skipif(attention.per_head_problem() is not None,
                                    reason="oneDNN's module is unavailable here")
needs_bf16 = pytest.mark.skipif(not precision.bf16_supported(),
                                reason="torch's oneDNN has no bf16 on this CPU")
needs_low_per_head = pytest.mark.skipif(
    attention.per_head_problem() is not None or onednn_direct.bf16_problem() is not None,
    reason="oneDNN's module or its bf16 products are unavailable here")


def _form(name, scale, masked):
    if name == "unfused":
        return lambda q, k, v, m=None: attention.unfused(q, k, v, m, scale=scale)
    return attention.PerHead(scale, masked, hidden_rows=True)


@pytest.mark.parametrize("form", ["unfused", pytest.param("per-head", marks=needs_per_head)])
@pytest.mark.parametrize("batch, lq, lk", [(1, 7, 7), (2, 5, 9), (1, 33, 17)])
@pytest.mark.parametrize("mask", [None, "keys", "per batch", "full"])
@pytest.mark.parametrize("scale", [0.125, -0.5])
def test_the_other_forms_match_the_fused_kernel(form, batch, lq, lk, mask, scale):
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
    got = _form(form, scale, additive is not None)(q, k, v, additive)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # laid out as the kernel's result: merging the heads afterwards copies nothing
    assert got.stride() == want.stride()


@needs_per_head
@pytest.mark.parametrize("layout", ["heads split", "contiguous", "columns strided"])
@pytest.mark.parametrize("lq, lk", [(40, 37), (1, 32), (16, 1)])
def test_the_per_head_form_reads_any_layout(layout, lq, lk):
    """sgemm reads rows in place where the last dimension is dense; else a copy is read
    (a single row's stride is anything, even below its length). Keys of a whole number
    of vectors, and less than one. Accuracy against float64 is that of the unfused form
    (bounded at twice its error)."""
    torch.manual_seed(0)
    b, h, d = 2, 4, 16
    q, k, v = _heads(b, lq, h, d), _heads(b, lk, h, d), _heads(b, lk, h, d)
    if layout == "contiguous":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    elif layout == "columns strided":     # (a single row: its stride 1, below its length)
        q, k, v = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (q, k, v))
    want = torch.softmax(q.double() @ k.double().transpose(2, 3) * 0.25, -1) @ v.double()
    got = attention.PerHead(0.25, masked=False, hidden_rows=False)(q, k, v)
    unfused = attention.unfused(q, k, v, scale=0.25)
    # laid out as the unfused form's result: [batch, lq, heads, dv] in memory
    assert got.transpose(1, 2).is_contiguous() and unfused.transpose(1, 2).is_contiguous()
    error = (got.double() - want).abs().max()
    assert error <= 2 * max(float((unfused.double() - want).abs().max()), 1e-7)


@needs_per_head
def test_the_per_head_form_keeps_nan_and_inf_where_the_unfused_form_does():
    torch.manual_seed(0)
    q, k, v = _heads(1, 20, 2, 8), _heads(1, 20, 2, 8), _heads(1, 20, 2, 8)
    q[0, 0, 3, 1] = float("nan")                         # one query's row: all NaN
    k[0, 1, 5, 2] = float("inf")                         # +inf and -inf scores in head 1
    mask = torch.zeros(1, 1, 20, 20)
    mask[..., 7, :] = float("-inf")                      # a hidden row
    for hidden_rows in (True, False):
        want = attention.unfused(q, k, v, mask, scale=0.5, hidden_rows=hidden_rows)
        got = attention.PerHead(0.5, masked=True, hidden_rows=hidden_rows)(q, k, v, mask)
        assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    # with no mask, a row of -inf scores is NaN, as torch's softmax gives
    k2 = k.clone()
    k2[...] = float("inf")
    q2 = -q.abs() - 1
    want = attention.unfused(q2, k2, v, scale=0.5)
    got = attention.PerHead(0.5, masked=False, hidden_rows=False)(q2, k2, v)
    assert want.isnan().all() and got.isnan().all()


@needs_per_head
def test_the_per_head_form_gives_the_same_result_under_any_thread_count():
    """Each (batch, head) pair is one thread's whole work: one thread or several, and one
    pair (whose sgemm may use the team itself) or several, give the same bits."""
    torch.manual_seed(0)
    form = attention.PerHead(0.3, masked=False, hidden_rows=False)
    threads = torch.get_num_threads()
    for heads in (3, 1):
        q, k, v = (_heads(1, 30, heads, 8) for _ in range(3))
        first = form(q, k, v)
        try:
            torch.set_num_threads(1)
            torch.testing.assert_close(form(q, k, v), first, atol=0, rtol=0)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(first, attention.unfused(q, k, v, scale=0.3),
                                   atol=1e-5, rtol=1e-5)


@needs_per_head
def test_its_output_is_float32_whatever_the_default_dtype():
    q, k, v = (_heads(1, 6, 2, 8) for _ in range(3))
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        got = attention.PerHead(0.3, masked=False, hidden_rows=False)(q, k, v)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, attention.unfused(q, k, v, scale=0.3), atol=1e-5,
                               rtol=1e-5)


def _low_reference(q, k, v, mask, scale):
    """Attention in float64 on the bf16 operands, a row the mask hides entirely 0."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = q @ k.transpose(2, 3) * scale
    if mask is not None:
        scores = scores + mask.double()
    hidden = scores.amax(-1, keepdim=True) == float("-inf")
    return torch.softmax(scores, -1).masked_fill(hidden, 0.0) @ v


@needs_low_per_head
@pytest.mark.parametrize("batch, lq, lk", [(1, 7, 7), (2, 5, 9), (1, 33, 17), (1, 40, 1),
                                          (1, 1, 9)])
@pytest.mark.parametrize("mask", [None, "keys", "per batch", "full", "offset", "lowest"])
@pytest.mark.parametrize("scale", [0.125, -0.5])
def test_the_bf16_per_head_form_is_within_bf16_rounding_of_float64(batch, lq, lk, mask,
                                                                  scale):
    """Its products read bf16 and accumulate in float32, its softmax and mask are float32,
    and its exps and result are rounded to bf16 once each: within a few parts in 1000 of
    float64 on the same bf16 operands (as torch's bf16 kernel), a row hidden by -inf 0.
    The mask is read in float32: a large bias ("offset") keeps its digits, and float32's
    lowest value ("lowest", what padding masks use) hides nothing entirely, as in float32
    (rounded to bf16 it would be -inf)."""
    torch.manual_seed(0)
    q, k, v = (_heads(batch, n, 3, 16).bfloat16() for n in (lq, lk, lk))
    shapes = {None: None, "keys": (lk,), "per batch": (batch, 1, 1, lk),
              "full": (batch, 3, lq, lk), "offset": (lk,), "lowest": (batch, 1, lq, lk)}
    additive = None if mask is None else torch.randn(shapes[mask])
    if mask in ("keys", "per batch", "full") and lk > 1:
        additive[..., 0] = float("-inf")                # a masked key
    if mask == "full":
        additive[0, 1, lq // 2] = float("-inf")         # a row hidden entirely: 0, not NaN
    if mask == "offset":
        additive -= 300.0
    if mask == "lowest":
        additive[..., -1] = torch.finfo(torch.float32).min
        additive[0, 0, lq // 2] = torch.finfo(torch.float32).min   # every key of a row
    got = attention.PerHead(scale, additive is not None, hidden_rows=True, low=True)(
        q, k, v, additive)
    want = _low_reference(q, k, v, additive, scale)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    if mask == "full":
        assert not got[0, 1, lq // 2].any()
    # laid out as the float32 form's result: [batch, lq, heads, dv] in memory
    assert got.transpose(1, 2).is_contiguous()
    if mask in ("offset", "lowest"):
        return  # (torch's bf16 kernel reads the mask rounded: another result)
    # as accurate as torch's own bf16 kernel on the same operands (relative L2 0.0017-0.0022
    # for both: each rounds the exps to bf16 and divides the result's rows by their sums)
    fused = _attention(q, k, v, additive, scale=scale, causal=False).double()
    fused = torch.nan_to_num(fused)                     # (its hidden row is NaN)

    def relative(x):
        return float((x - want).norm() / want.norm().clamp_min(1e-30))
    assert relative(got.double()) <= min(1.25 * relative(fused) + 1e-4, 5e-3)


@needs_low_per_head
@pytest.mark.parametrize("layout", ["heads split", "columns strided", "from one product"])
def test_the_bf16_per_head_form_reads_any_layout(layout):
    """oneDNN's bf16 products read a pair's rows dense: a head's strided rows are gathered
    first, dense ones read in place; the result is the same bits."""
    torch.manual_seed(0)
    q, k, v = (_heads(2, n, 4, 16).bfloat16() for n in (9, 13, 13))
    form = attention.PerHead(0.25, masked=False, hidden_rows=False, low=True)
    want = form(q.contiguous(), k.contiguous(), v.contiguous())      # dense rows
    if layout == "columns strided":
        q, k, v = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (q, k, v))
    elif layout == "from one product":  # q, k and v sliced from one [b, s, 3 * h * d]
        q, k, v = (torch.cat([x.transpose(1, 2).reshape(2, -1, 64)] * 3, -1)
                   .view(2, -1, 3, 4, 16)[:, :, i].transpose(1, 2) for i, x in enumerate((q, k, v)))
        assert q.stride(2) == 3 * 64
    got = form(q, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(got.double(), _low_reference(q, k, v, None, 0.25),
                               atol=1e-2, rtol=1e-2)


@needs_low_per_head
def test_the_bf16_per_head_form_keeps_nan_and_reads_only_its_types():
    torch.manual_seed(0)
    q, k, v = (_heads(1, 20, 2, 8).bfloat16() for _ in range(3))
    q[0, 0, 3, 1] = float("nan")                         # one query's row: all NaN
    form = attention.PerHead(0.5, masked=False, hidden_rows=False, low=True)
    got = form(q, k, v)
    assert got[0, 0, 3].isnan().all() and not got[0, 0, :3].isnan().any()
    assert not got[0, 1].isnan().any()
    with pytest.raises(ValueError, match="bfloat16"):
        form(q.float(), k, v)
    masked = attention.PerHead(0.5, masked=True, hidden_rows=False, low=True)
    with pytest.raises(ValueError, match="mask"):
        masked(q, k, v, torch.zeros(20).bfloat16())        # the mask stays float32
    with pytest.raises(ValueError, match="without its mask"):
        masked(q, k, v)


@needs_low_per_head
def test_the_bf16_per_head_form_gives_the_same_result_under_any_thread_count():
    """Each pair's products are made for one thread: the team's size, at its making or at
    a call, changes nothing."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    for batch, heads in ((2, 3), (1, 1)):                # (one pair: still one thread's)
        q, k, v = (_heads(batch, 30, heads, 16).bfloat16() for _ in range(3))
        made_in_team = attention.PerHead(0.3, masked=False, hidden_rows=False, low=True)
        made_alone = attention.PerHead(0.3, masked=False, hidden_rows=False, low=True)
        first = made_in_team(q, k, v)
        try:
            torch.set_num_threads(1)
            alone = made_alone(q, k, v)                   # made under one thread
            torch.testing.assert_close(made_in_team(q, k, v), first, atol=0, rtol=0)
        finally:
            torch.set_num_threads(threads)
        torch.testing.assert_close(alone, first, atol=0, rtol=0)
        torch.testing.assert_close(made_alone(q, k, v), first, atol=0, rtol=0)
        torch.testing.assert_close(first.double(), _low_reference(q, k, v, None, 0.3),
                                   atol=1e-2, rtol=1e-2)


@needs_low_per_head
def test_a_model_s_bf16_per_head_step_reads_its_mask_in_float32(monkeypatch):
    """A constant padding mask of float32's lowest value, as models build it: the bf16
    per-head step keeps it finite (hides nothing entirely), as the float32 forms do."""
    monkeypatch.setattr(attention, "choose", lambda node, db=None, mask=None, **_:
                        attention.LOW_PER_HEAD)
    _, node = _node(mask_dtype=torch.float32, seq=8)
    constant = torch.zeros(1, 1, 1, 8)
    constant[..., 6:] = torch.finfo(torch.float32).min
    name, step, reads = attention.measured(node, constant_mask=constant, precision="bf16")
    assert name == attention.LOW_PER_HEAD and reads == 4
    q, k, v = (_heads(1, 8, 2, 8) for _ in range(3))
    (got,) = step(q, k, v, constant)
    (handed_on,) = step(q, k, v, constant.bfloat16().float().bfloat16())   # a bf16 mask
    want = attention.PerHead(0.3, masked=True, hidden_rows=False)(q, k, v, constant)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert not handed_on.isnan().any()


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
    assert record.config["form"] == chosen
    assert set(record.samples) == set(attention._offered(node)) >= {"fused", "unfused"}
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


@pytest.mark.parametrize("form", ["fused", "unfused",
                                  pytest.param("per-head", marks=needs_per_head), None])
def test_a_model_runs_the_chosen_form_and_the_native_plan_replays_it(form, monkeypatch):
    """None: unmeasured (measure=False), the op's own form."""
    if form is not None:
        monkeypatch.setattr(attention, "choose", lambda node, db=None, mask=None, **_: form)
    python_calls = []
    per_head = attention.PerHead.__call__
    monkeypatch.setattr(attention.PerHead, "__call__",
                        lambda self, *a: python_calls.append(1) or per_head(self, *a))
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
        replayed_from = len(python_calls)
        torch.testing.assert_close(compiled(x, mask), model(x, mask), atol=1e-5, rtol=1e-5)
    # the per-head form's raw call is in the plan: Python no longer calls it
    assert len(python_calls) == replayed_from and (form == "per-head") == (replayed_from > 0)


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


def _measured_forms(monkeypatch) -> dict:
    """The forms `choose` hands to `choice.measure`, filled in as it measures them."""
    measured = {}
    original = attention.choice.measure
    monkeypatch.setattr(attention.choice, "measure", lambda forms, *a, **k: (
        measured.update(forms) or original(forms, *a, **k)))
    return measured


def _disagreeing(monkeypatch, form: str, spoil) -> None:
    """`form`'s result spoiled by `spoil`, the other forms as they are."""
    bound = attention._bound
    monkeypatch.setattr(attention, "_bound", lambda name, node, mask: (
        (lambda *args: spoil(bound(name, node, mask)(*args))) if name == form
        else bound(name, node, mask)))


@needs_per_head
def test_a_form_that_disagrees_with_the_fused_kernel_is_not_measured(monkeypatch):
    monkeypatch.setattr(attention, "_CHOICES", {})
    _, node = _node(mask_dtype=torch.float32, seq=24)
    _disagreeing(monkeypatch, "per-head", lambda out: out + 1e-3)
    measured = _measured_forms(monkeypatch)
    assert attention.choose(node) in ("fused", "unfused")
    assert set(measured) == {"fused", "unfused"}


@needs_bf16
def test_under_bf16_the_fused_kernel_on_bf16_operands_is_a_form_too(monkeypatch):
    """It is measured beside the float32 forms, on operands already in bf16 (as the
    products before it hand them on), after agreeing with the float32 kernel within bf16's
    rounding, and recorded under a key of its own."""
    monkeypatch.setattr(attention, "_CHOICES", {})
    _, node = _node(mask_dtype=torch.float32, seq=24)
    low_forms = attention.LOW_FORMS if attention.per_head_problem() is None and \
        onednn_direct.bf16_problem() is None else (attention.LOW_FORM,)
    assert attention._offered(node, "bf16") == attention._offered(node) + low_forms
    mask = attention.Mask(node, None)
    assert attention._key(node, mask, "bf16") != attention._key(node, mask)
    measured = _measured_forms(monkeypatch)
    assert attention.choose(node, precision="bf16") in attention._offered(node, "bf16")
    assert set(measured) == set(attention._offered(node, "bf16"))
    for form in low_forms:  # (the per-head form reads its mask in float32)
        operands = measured[form].measured_args(attention._examples(node, mask))
        mask_type = torch.float32 if form == attention.LOW_PER_HEAD else torch.bfloat16
        assert [t.dtype for t in operands] == [torch.bfloat16] * 3 + [mask_type]


@needs_bf16
def test_a_bf16_form_that_disagrees_is_not_measured(monkeypatch):
    monkeypatch.setattr(attention, "_CHOICES", {})
    _, node = _node(mask_dtype=torch.float32, seq=24)
    _disagreeing(monkeypatch, attention.LOW_FORM, lambda out: out * 1.1)
    measured = _measured_forms(monkeypatch)
    assert attention.choose(node, precision="bf16") != attention.LOW_FORM
    assert attention.LOW_FORM not in measured


@needs_bf16
@pytest.mark.parametrize("form", [attention.LOW_FORM,
                                  pytest.param(attention.LOW_PER_HEAD,
                                               marks=needs_low_per_head), "unfused"])
def test_a_bf16_model_computes_its_attention_in_the_chosen_form(form, monkeypatch):
    """A bf16 form runs as a bf16 step ("attention [bf16]", "attention (per-head) [bf16]");
    a float32 form that measured faster computes in float32, so the attention is only
    more accurate. The native plan replays the per-head form's raw call."""
    monkeypatch.setattr(attention, "choose", lambda node, db=None, mask=None, **_: form)
    python_calls = []
    per_head = attention.PerHead.__call__
    monkeypatch.setattr(attention.PerHead, "__call__",
                        lambda self, *a: python_calls.append(1) or per_head(self, *a))
    torch.manual_seed(0)
    model, x = _Block().eval(), torch.randn(2, 12, 32)
    mask = torch.zeros(2, 1, 1, 12)
    mask[1, ..., -3:] = float("-inf")
    compiled = opweave.compile(model, (x, mask), options=Options(
        deterministic=True, tuning_db=None, native="wait", precision="bf16"))
    executor = compiled.program.compiled_graphs[0].executor
    (step,) = [s for s in executor.lowered_steps if s.nodes[0].op == "attention"]
    low = form in attention.LOW_FORMS
    names = {attention.LOW_FORM: "attention [bf16]",
             attention.LOW_PER_HEAD: "attention (per-head) [bf16]"}
    assert (step.name, step.precision) == ((names[form], "bf16") if low
                                           else ("attention (unfused)", "fp32"))
    # the step's own result: rounded to bf16 (every value a bf16 one) only in a bf16 form
    q, k, v = (_heads(2, 12, 4, 8) for _ in range(3))
    (out,) = step.fn(q, k, v, mask)
    assert out.dtype == torch.float32     # widened: graph outputs read it, not bf16 steps
    rounded = torch.equal(out, out.bfloat16().float())
    assert rounded == low
    with torch.no_grad():
        for _ in range(3):
            compiled(x, mask)
        assert executor.native.plan is not None, executor.native.describe()
        replayed_from = len(python_calls)
        got = compiled(x, mask)
        reference = model.double()(x.double(), mask.double())
    assert got.dtype == torch.float32
    assert float((got.double() - reference).norm() / reference.norm()) < 2e-2
    # the per-head form's raw call is in the plan: Python no longer calls it
    assert len(python_calls) == replayed_from
    assert (replayed_from > 0) == (form == attention.LOW_PER_HEAD)


def test_the_fused_kernels_inference_form_runs_the_kernel_alone():
    """Inference reads only the attention: the logsumexp the kernel also returns is not
    copied (a training step's `_attention_lse` lays it out [batch, heads, seq])."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opweave.ir.ops.linalg import _attention_lse

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = (_heads(1, 16, 2, 8).contiguous() for _ in range(3))
    with Ops() as ops:
        out = _attention(q, k, v, scale=0.35, causal=False)
    assert ops.seen == ["_scaled_dot_product_flash_attention_for_cpu"]
    want, lse = _attention_lse(q, k, v, scale=0.35, causal=False)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert lse.shape == (1, 2, 16) and lse.is_contiguous()
