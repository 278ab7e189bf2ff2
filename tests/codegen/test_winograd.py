"""Winograd's F(2x2, 3x3) convolutions (codegen/onednn_winograd.cpp) against float64."""
from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from opweave.codegen import library, lower, onednn_direct
from opweave.ir import Graph, TensorType
from opweave.partition.legality import Epilogue
from opweave.runtime import Executor

from .test_onednn_direct import assert_replayed_natively

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="oneDNN's pip package is for x86-64 Linux")
NONE, IN_PLACE, ADD = onednn_direct.NO_BINARY, onednn_direct.SUM_IN_PLACE, onednn_direct.ADD


def _conv(x, weight, bias, padding, unary, residual):
    y = F.conv2d(x, weight, bias, 1, padding)
    if residual is not None:
        y = y + residual
    return y.relu() if unary == "relu" else y


def _geometry(n, c, h, w, o, padding):
    ph, pw = padding if isinstance(padding, tuple) else (padding, padding)
    return n, c, h, w, o, 3, 3, 1, 1, 1, ph, pw, 1, 1


@pytest.mark.parametrize("shape", [
    # N, C, H, W, O, padding: odd sizes (a partial last tile), channels that are not a
    # multiple of the 16 transformed together, two images, padding 0, 2, 3 (whole tiles of
    # padding) and unequal
    (1, 16, 8, 8, 16, 1),
    (2, 20, 9, 7, 24, 1),
    (1, 32, 5, 6, 17, 0),
    (1, 8, 4, 4, 8, 2),
    (1, 5, 3, 4, 3, 3),
    (3, 17, 6, 5, 31, (2, 0)),
    (1, 64, 14, 14, 64, 1),
])
@pytest.mark.parametrize("unary", [None, "relu"])
@pytest.mark.parametrize("binary", [NONE, IN_PLACE, ADD])
def test_its_error_is_float32s(shape, unary, binary):
    """Against float64, within 2x the error of torch's float32 convolution (measured
    1.1-1.5x on ResNet-50's shapes; F(4x4, 3x3) was 20-30x)."""
    n, c, h, w, o, p = shape
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, c, h, w), torch.randn(o, c, 3, 3) / (3 * c ** 0.5), \
        torch.randn(o)
    conv = onednn_direct.WinogradConv(_geometry(n, c, h, w, o, p), weight, bias, unary, binary)
    p = _geometry(n, c, h, w, o, p)[10:12]
    residual = None if binary == NONE else \
        torch.randn(conv.out_shape).contiguous(memory_format=torch.channels_last)
    exact = _conv(x.double(), weight.double(), bias.double(), p, unary,
                  None if residual is None else residual.double())
    float32 = _conv(x, weight, bias, p, unary, residual)
    given = None if residual is None else residual.clone()
    got = conv(x) if given is None else conv(x, given)
    assert got.shape == exact.shape and got.is_contiguous(memory_format=torch.channels_last)
    error = (got.double() - exact).abs().max().item()
    assert error <= 2 * (float32.double() - exact).abs().max().item() + 1e-7
    assert conv.fallbacks() == 0                          # transformed, not the fallback
    if binary == IN_PLACE:
        assert got.data_ptr() == given.data_ptr()        # added into the residual itself
    elif given is not None:
        torch.testing.assert_close(given, residual, atol=0, rtol=0)  # the residual unchanged


def _direct(binary, unary="relu"):
    """A Winograd convolution 16 -> 16 over 8x8 and the direct one, on the same weights."""
    torch.manual_seed(1)
    weight, bias = torch.randn(16, 16, 3, 3), torch.randn(16)
    geometry = _geometry(1, 16, 8, 8, 16, 1)
    return (onednn_direct.WinogradConv(geometry, weight, bias, unary, binary),
            onednn_direct.DirectConv(geometry, weight, bias, unary, binary))


def _both(winograd, direct, x, residual):
    if residual is None:
        return winograd(x), direct(x)
    return winograd(x, residual.clone()), direct(x, residual.clone())


def _same_non_finite(got, want):
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("binary", [NONE, IN_PLACE, ADD])
@pytest.mark.parametrize("unary", [None, "relu"])
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan", "inf and -inf together"])
def test_a_non_finite_input_gives_what_the_direct_convolution_gives(binary, unary, bad):
    """The transforms subtract inputs, so an infinity could come out NaN: such a call runs
    the direct convolution instead, on the weights as given."""
    winograd, direct = _direct(binary, unary)
    x = torch.randn(1, 16, 8, 8)
    if bad == "inf and -inf together":     # in the same windows: NaN where they meet
        x[0, 3, 4, 4], x[0, 5, 4, 5] = float("inf"), float("-inf")
    else:
        x[0, 3, 4, 4] = float(bad)
    residual = None if binary == NONE else \
        torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    got, want = _both(winograd, direct, x, residual)
    assert not want.isfinite().all() or unary == "relu"
    _same_non_finite(got, want)
    assert winograd.fallbacks() == 1
    clean = torch.randn(1, 16, 8, 8)                      # finite again: transformed again
    got, want = _both(winograd, direct, clean, residual)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert winograd.fallbacks() == 1


@pytest.mark.parametrize("binary", [IN_PLACE, ADD])
def test_a_nan_residual_gives_what_the_direct_convolution_gives(binary):
    """relu maps NaN to 0 in both forms (as oneDNN's relu post-op does)."""
    winograd, direct = _direct(binary)
    residual = torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    residual[0, 2, 3, 3], residual[0, 4, 0, 0] = float("nan"), float("inf")
    got, want = _both(winograd, direct, torch.randn(1, 16, 8, 8), residual)
    _same_non_finite(got, want)
    assert winograd.fallbacks() == 0


@pytest.mark.parametrize("geometry, unary", [
    ((1, 8, 8, 8, 8, 3, 3, 1, 2, 2, 1, 1, 1, 1), None),     # stride 2
    ((1, 8, 8, 8, 8, 5, 5, 1, 1, 1, 2, 2, 1, 1), None),     # 5x5
    ((1, 8, 8, 8, 8, 3, 3, 2, 1, 1, 1, 1, 1, 1), None),     # two groups
    ((1, 8, 8, 8, 8, 3, 3, 1, 1, 1, 2, 2, 2, 2), None),     # dilated
    ((1, 8, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1), ("gelu", "none")),
])
def test_a_convolution_it_cannot_compute_is_refused(geometry, unary):
    weight = torch.randn(8, 8 // geometry[7], geometry[5], geometry[6])
    assert not onednn_direct.winograd_fits(geometry, unary, weight, None)
    with pytest.raises(ValueError, match="no Winograd form"):
        onednn_direct.WinogradConv(geometry, weight, None, unary)


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_a_non_finite_weight_or_bias_is_refused(where):
    """G has zeros: one infinite weight would make NaN of every product it meets."""
    weight, bias = torch.randn(8, 8, 3, 3), torch.randn(8)
    (weight if where == "weight" else bias).view(-1)[3] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        onednn_direct.WinogradConv(_geometry(1, 8, 8, 8, 8, 1), weight, bias)


def test_another_thread_count_gets_a_primitive_of_its_own():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 32, 14, 14), torch.randn(64, 32, 3, 3) / 17
    conv = onednn_direct.WinogradConv(_geometry(1, 32, 14, 14, 64, 1), weight, None, "relu")
    want = F.conv2d(x, weight, None, 1, 1).relu()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.testing.assert_close(conv(x), want, atol=1e-5, rtol=1e-4)
        torch.set_num_threads(2)
        torch.testing.assert_close(conv(x), want, atol=1e-5, rtol=1e-4)
        assert conv.variants() == 1
    finally:
        torch.set_num_threads(threads)


def _block(stride: int = 1) -> Graph:
    """conv+relu, then conv + residual add + relu (ResNet's groups), 3x3."""
    g = Graph("block")
    x = g.add_input("x", TensorType((1, 16, 10, 10), torch.float32))

    def conv(v, name, s):
        w = g.add_constant(f"{name}_w", torch.randn(16, 16, 3, 3) / 12)
        b = g.add_constant(f"{name}_b", torch.randn(16))
        return g.add1("conv", [v, w, b], {"stride": [s, s], "padding": [1, 1],
                                          "dilation": [1, 1], "groups": 1})
    h = g.add1("relu", [conv(x, "c1", 1)])
    g.outputs = [g.add1("relu", [g.add1("add", [conv(h, "c2", 1), x])])] if stride == 1 \
        else [conv(h, "c2", stride)]
    return g


offered_here = pytest.mark.skipif(onednn_direct.library() is None
                                  or onednn_direct.winograd_problem() is not None,
                                  reason="the form is not offered on this CPU")


def test_it_is_not_offered_where_onednn_has_no_brgemm_products():
    """Held to AVX2, oneDNN 3.2 runs batched products on an older GEMM, where the form was
    slower than the direct convolution (onednn_direct.winograd_problem)."""
    import os
    import subprocess
    script = ("from opweave.codegen import onednn_direct as od; "
              "print(od.winograd_problem())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    # (a later oneDNN with brgemm products on AVX2 would offer it: "None")
    assert "not its brgemm kernels" in out.stdout or "unavailable" in out.stdout \
        or out.stdout.strip() == "None" and "brg" in _kernel_under_avx2()


def _kernel_under_avx2() -> str:
    import os
    import subprocess
    script = ("import torch; from opweave.codegen import onednn_direct as od; "
              "c = od.WinogradConv((1, 64, 8, 8, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1), "
              "torch.zeros(64, 64, 3, 3), None); print(c.implementation())")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}).stdout


@offered_here
def test_the_library_offers_it_to_3x3_convolutions_of_stride_1_only():
    g = _block(stride=2)
    first, second = [n for n in g.nodes if n.op == "conv"]
    relu = next(n for n in g.nodes if n.op == "relu")
    assert "onednn-winograd" in library.forms(g, first, Epilogue(unary=relu, chain=(relu,)))
    assert "onednn-winograd" not in library.forms(g, second, Epilogue())


@offered_here
def test_a_convolution_of_few_channels_is_not_offered_it():
    g = Graph("narrow")
    x = g.add_input("x", TensorType((1, 3, 10, 10), torch.float32))
    w = g.add_constant("w", torch.randn(16, 3, 3, 3))
    conv = g.add1("conv", [x, w], {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
                                  "groups": 1})
    g.outputs = [conv]
    assert "onednn-direct" in library.forms(g, conv.producer, Epilogue())
    assert "onednn-winograd" not in library.forms(g, conv.producer, Epilogue())


@offered_here
def test_a_decision_made_without_it_is_keyed_apart(monkeypatch):
    """Where it is withheld (here: the probe says so), the decision is another one: a
    record made then must not be taken where it is offered and was never measured."""
    g = _block()
    anchor = next(n for n in g.nodes if n.op == "conv")
    offered = library.signature(g, anchor, Epilogue())
    monkeypatch.setattr(onednn_direct, "winograd_problem", lambda: "held to AVX2")
    assert "onednn-winograd" not in library.forms(g, anchor, Epilogue())
    assert library.signature(g, anchor, Epilogue()) == \
        offered + (("without", "onednn-winograd"),)


@offered_here
def test_the_lowering_runs_resnets_groups_on_it_and_the_native_plan_replays_them():
    g = _block()
    lowered = lower(g, "ilp", measure=False)
    names = [s.name for s in lowered.steps if s.kind == "library"]
    assert names == ["conv+relu [winograd]", "conv+add+relu [winograd]"]
    x = torch.randn(1, 16, 10, 10)
    torch.testing.assert_close(Executor(g, steps=lowered.steps)(x)[0], Executor(g)(x)[0],
                               atol=1e-4, rtol=1e-4)
    assert_replayed_natively(_block(), (1, 16, 10, 10))
