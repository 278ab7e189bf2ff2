"""Anchor groups on oneDNN (packed weights, post-ops) against the reference ops."""
from __future__ import annotations

import pytest
import torch

from opweave.codegen import choice, library, lower, onednn_direct
from opweave.codegen import precision as prec
from opweave.codegen.render import FUSIBLE
from opweave.ir import Graph, TensorType
from opweave.runtime import Executor

from ..partition.graphs import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="needs torch built with oneDNN")
F32 = torch.float32


def _run(g: Graph, *inputs, names):
    lowered = lower(g, "ilp", measure=False)
    assert [s.name for s in lowered.steps if s.kind == "library"] == names
    got = Executor(g, steps=lowered.steps)(*inputs)
    ref = Executor(g)(*inputs)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act", [("gelu", "none"), ("gelu", "tanh"), ("relu", None),
                                 ("tanh", None), ("sigmoid", None), ("clamp", None)])
def test_linear_with_activation_post_op(act):
    op, approx = act
    g = Graph("lin")
    x = g.add_input("x", TensorType((6, 24), F32))
    y = linear(g, x, 24, 40, "fc")
    attrs = {"approximate": approx} if approx else {"min": 0.0, "max": 6.0} if op == "clamp" else {}
    g.outputs = [g.add1(op, [y], attrs)]
    _run(g, torch.randn(6, 24), names=[f"matmul+add+{op}"])


def test_linear_with_residual_post_op():
    g = Graph("res")
    x = g.add_input("x", TensorType((1, 6, 24), F32))
    flat = g.add1("reshape", [x], {"shape": [6, 24]})
    y = g.add1("reshape", [linear(g, flat, 24, 24, "fc")], {"shape": [1, 6, 24]})
    g.outputs = [g.add1("add", [x, y])]          # residual on the left: add commutes
    _run(g, torch.randn(1, 6, 24), names=["matmul+add+reshape+add"])


def _conv(g, x, c_in, c_out, k, name, rank=2):
    w = g.add_constant(f"{name}_w", torch.randn(c_out, c_in, *([k] * rank)) / (c_in * k) ** 0.5)
    b = g.add_constant(f"{name}_b", torch.randn(c_out))
    attrs = {"stride": [1] * rank, "padding": [k // 2] * rank, "dilation": [1] * rank}
    return g.add1("conv", [x, w, b], attrs)


def test_conv_relu_and_residual_add_relu():
    g = Graph("block")
    x = g.add_input("x", TensorType((1, 16, 9, 9), F32))
    h = g.add1("relu", [_conv(g, x, 16, 16, 3, "c1")])
    y = g.add1("relu", [g.add1("add", [_conv(g, h, 16, 16, 3, "c2"), x])])
    g.outputs = [y]
    # measure=False takes Winograd's form for 3x3 convolutions where it is offered
    winograd = " [winograd]" if library._winograd_offered() else ""
    _run(g, torch.randn(1, 16, 9, 9), names=[f"conv+relu{winograd}", f"conv+add+relu{winograd}"])


def test_conv1d_reads_a_transposed_input_in_place():
    g = Graph("c1d")
    x = g.add_input("x", TensorType((1, 20, 16), F32))          # [N, L, C] as XML-CNN has it
    t = g.add1("permute", [x], {"dims": [0, 2, 1]})
    g.outputs = [g.add1("relu", [_conv(g, t, 16, 8, 3, "c", rank=1)])]
    _run(g, torch.randn(1, 20, 16), names=["conv+relu"])


def test_choice_is_measured_once_per_shape(monkeypatch):
    """The measured choice is memoized per shape; a fake clock makes "slow" slow on any
    machine (the test asserts the bookkeeping, not this CPU's speed)."""
    clock = [0.0]
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock[0])
    calls = {"slow": 0, "fast": 0}

    def make(name, seconds):
        def fn(x):
            calls[name] += 1
            clock[0] += seconds
            return [x]
        return fn
    g = Graph("k")
    v = g.add_input("x", TensorType((64, 64), F32))
    key = ("test", "shape")
    best, seconds = choice.choose(key, {"slow": make("slow", 1e-3), "fast": make("fast", 1e-6)}, [v])
    assert best == "fast" and seconds == pytest.approx(1e-6)
    before = dict(calls)
    assert choice.choose(key, {"slow": make("slow", 1e-3), "fast": make("fast", 1e-6)}, [v])[0] == "fast"
    assert calls == before


def test_size_classes_round_every_size_up_to_a_power_of_two():
    key = ("matmul", (), ("f32[2,100,768]", "f32[768,3072]"), (("add", "[]"),))
    assert choice.size_class(key) == ("matmul", (), ("f32[2,128,1024]", "f32[1024,4096]"),
                                       (("add", "[]"),))
    assert choice.size_class(("conv", (), ("f32[1,3,5,5]",), (), ("precision", "bf16"))) == \
        ("conv", (), ("f32[1,4,8,8]",), (), ("precision", "bf16"))


def test_a_size_class_serves_the_sizes_in_it_with_their_flops(monkeypatch):
    """Within `by_size_class`, the first signature of a class is measured; another of the
    same class takes its form, its time scaled by FLOPs; another class is measured."""
    clock = [0.0]
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(choice, "_CHOICES", {})
    monkeypatch.setattr(choice, "_CLASS_CHOICES", {})
    measured = []

    def form(seconds):
        def fn(x):
            clock[0] += seconds
            return [x]
        return fn
    forms = {"slow": form(4e-3), "fast": form(1e-3)}
    real = choice.measure
    monkeypatch.setattr(choice, "measure", lambda c, args, rounds=7: measured.append(
        args[0].shape) or real(c, args, rounds))
    g = Graph("k")
    small, other = (g.add_input(n, TensorType(s, F32)) for n, s in (("a", (100, 8)), ("b", (20, 8))))

    def key(rows):
        return ("matmul", (), (f"f32[{rows},8]",), ())
    with choice.by_size_class():
        assert choice.choose(key(100), forms, [small], work=1000.0) == ("fast", pytest.approx(1e-3))
        assert choice.choose(key(120), forms, [small], work=1500.0) == ("fast", pytest.approx(1.5e-3))
        assert choice.measured(key(110), work=500.0) == pytest.approx(0.5e-3)
        assert len(measured) == 1
        choice.choose(key(20), forms, [other], work=200.0)   # class 32: measured
        assert len(measured) == 2
    choice.choose(key(90), forms, [small], work=900.0)      # outside: every size measured
    assert len(measured) == 3


def test_a_linear_with_a_residual_calls_its_overload_directly(monkeypatch):
    """torch resolves `_linear_pointwise(x, other, ...)` by trying the unary schema first,
    whose failure formats every tensor into its message (5 ms a call on a 200x768 input):
    the form names the binary overload, so no tensor is ever formatted."""
    g = Graph("res")
    x = g.add_input("x", TensorType((6, 24), F32))
    g.outputs = [g.add1("add", [linear(g, x, 24, 24, "fc"), x])]
    lowered = lower(g, "ilp", measure=False)
    (step,) = [s for s in lowered.steps if s.kind == "library"]

    def no_repr(self, *args, **kwargs):
        raise AssertionError("a tensor was formatted")
    monkeypatch.setattr(torch.Tensor, "__repr__", no_repr)
    inputs = torch.randn(6, 24)
    (got,) = step.fn(*[inputs for _ in step.inputs])
    monkeypatch.undo()
    (want,) = Executor(g)(inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_weight_view_a_library_form_holds_packed_is_computed_by_no_step():
    """A linear layer's weight is a transposed view of a constant (the layout pass's form);
    the library form holds it packed, so no step computes the view on each call. The
    reference form reads the view, so there it stays."""
    g = Graph("lin")
    x = g.add_input("x", TensorType((6, 24), F32))
    g.outputs = [g.add1("relu", [linear(g, x, 24, 40, "fc")])]
    lowered = lower(g, "ilp", measure=False)
    assert [s.kind for s in lowered.steps] == ["library"]
    assert [v.name for v in lowered.steps[0].inputs] == ["x"]
    inputs = torch.randn(6, 24)
    torch.testing.assert_close(Executor(g, steps=lowered.steps)(inputs)[0], Executor(g)(inputs)[0])


def test_pointwise_conv_as_gemm_matches():
    g = Graph("c1x1")
    x = g.add_input("x", TensorType((1, 16, 5, 7), F32))
    y = g.add1("relu", [_conv(g, x, 16, 24, 1, "p")])
    g.outputs = [y]
    lowered = lower(g, "ilp", measure=False)
    (step,) = [s for s in lowered.steps if s.kind == "library"]
    from opweave.codegen.lower import _anchor_candidates
    from opweave.partition.context import Context

    ctx = Context(g, FUSIBLE)
    group = frozenset(step.nodes)
    _, candidates, ins, _, _ = _anchor_candidates(g, ctx, group, step.nodes, step.outputs)
    assert "onednn-gemm" in candidates
    xin = torch.randn(1, 16, 5, 7).contiguous(memory_format=torch.channels_last)
    (got,) = candidates["onednn-gemm"](xin)
    assert len(ins) == 1                       # weight and bias are baked in
    (ref,) = candidates["reference"](xin)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("residual_read_later", [False, True])
def test_conv_adds_into_a_dead_residual_only(residual_read_later):
    g = Graph("inplace")
    x = g.add_input("x", TensorType((1, 16, 6, 6), F32))
    r = g.add1("relu", [_conv(g, x, 16, 16, 1, "c0")])          # the residual
    h = g.add1("relu", [_conv(g, r, 16, 16, 3, "c1")])
    y = g.add1("relu", [g.add1("add", [_conv(g, h, 16, 16, 1, "c2"), r])])
    g.outputs = [y, r] if residual_read_later else [y]
    lowered = lower(g, "ilp", measure=False)
    names = [s.name for s in lowered.steps if s.kind == "library"]
    assert names[-1] == ("conv+add+relu" if residual_read_later
                         else "conv+add+relu (into its residual)")
    inp = torch.randn(1, 16, 6, 6)
    got = Executor(g, steps=lowered.steps)(inp)
    ref = Executor(g)(inp)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_zero_padding_before_a_convolution_keeps_its_operand_channels_last():
    """An unequal zero padding (a stride-2 convolution's 0 before, 1 after) stays a cat in
    the graph; it runs as `constant_pad_nd`, whose result stays channels-last where `cat`
    would make it row-major, and a cat with a nonzero block stays a cat."""
    g = Graph("pad")
    x = g.add_input("x", TensorType((1, 8, 6, 6), F32))
    y = g.add1("relu", [_conv(g, x, 8, 8, 3, "c")])              # channels-last, as in models
    padded = g.add1("cat", [y, g.add_constant("zeros", torch.zeros(1, 8, 6, 1))], {"dim": 3})
    other = g.add1("cat", [y, g.add_constant("ones", torch.ones(1, 8, 6, 1))], {"dim": 3})
    g.outputs = [padded, other]
    lowered = lower(g, "ilp", measure=False)
    pad_step, cat_step = (next(s for s in lowered.steps if v in s.outputs) for v in (padded, other))
    assert pad_step.name == "cat (zero padding)" and pad_step.inputs == [y]
    assert cat_step.name == "cat"
    data = torch.randn(1, 8, 6, 6)
    got = Executor(g, steps=lowered.steps)(data)
    for a, b in zip(got, Executor(g)(data)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    conv_out = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    (result,) = pad_step.fn(conv_out)
    assert result.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(result, torch.cat([conv_out, torch.zeros(1, 8, 6, 1)], 3))


def _same_padded_depthwise(after: int):
    """A convolution + ReLU, then TensorFlow's "SAME" zero padding before a stride-2
    depthwise convolution: 0 rows and columns before, `after` after, as nested cats."""
    g = Graph("same")
    x = g.add_input("x", TensorType((1, 16, 8, 8), F32))
    y = g.add1("relu", [_conv(g, x, 16, 16, 1, "c1")])
    rows = g.add1("cat", [y, g.add_constant("zr", torch.zeros(1, 16, after, 8))], {"dim": 2})
    padded = g.add1("cat", [rows, g.add_constant("zc", torch.zeros(1, 16, 8 + after, after))],
                    {"dim": 3})
    w = g.add_constant("dw_w", torch.randn(16, 1, 3, 3))
    b = g.add_constant("dw_b", torch.randn(16))
    out = g.add1("conv", [padded, w, b], {"stride": [2, 2], "padding": [0, 0],
                                          "dilation": [1, 1], "groups": 16})
    g.outputs = [g.add1("relu", [out])]
    return g, y


@pytest.mark.skipif(onednn_direct.library() is None, reason="needs oneDNN's own library")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_unequal_zero_padding_is_absorbed_by_the_direct_convolution(precision):
    """The direct form pads each side by its own amount: the convolution reads the
    activation before its padding, and the padding's copies are gone; the result is the
    padded convolution's (bf16: within bf16's rounding of it)."""
    if precision == "bf16" and not prec.bf16_supported():
        pytest.skip("no bf16 here")
    g, y = _same_padded_depthwise(after=1)
    lowered = lower(g, "ilp", measure=False, precision=precision)
    (step,) = [s for s in lowered.steps if s.kind == "library" and "absorbed" in s.name]
    assert step.inputs[0] is y
    assert not any("cat" in s.name for s in lowered.steps)
    data = torch.randn(1, 16, 8, 8)
    got = Executor(g, steps=lowered.steps)(data)
    tolerance = 1e-4 if precision == "fp32" else 3e-2
    for a, b in zip(got, Executor(g)(data)):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_zero_padding_beyond_the_kernels_reach_stays_a_copy():
    g, _ = _same_padded_depthwise(after=3)
    lowered = lower(g, "ilp", measure=False)
    assert not any("absorbed" in s.name for s in lowered.steps)
    assert sum(s.name == "cat (zero padding)" for s in lowered.steps) == 2
    data = torch.randn(1, 16, 8, 8)
    for a, b in zip(Executor(g, steps=lowered.steps)(data), Executor(g)(data)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
