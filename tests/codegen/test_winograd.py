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
    return n, c, h, w, o, 3, 3, 1, 1, 1, padding, padding, 1, 1


@pytest.mark.parametrize("shape", [
    # N, C, H, W, O, padding: odd sizes (a partial last tile), channels that are not a
    # multiple of the 16 transformed together, two images, padding 0 and 2
    (1, 16, 8, 8, 16, 1),
    (2, 20, 9, 7, 24, 1),
    (1, 32, 5, 6, 17, 0),
    (1, 8, 4, 4, 8, 2),
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
    if binary == IN_PLACE:
        assert got.data_ptr() == given.data_ptr()        # added into the residual itself
    elif given is not None:
        torch.testing.assert_close(given, residual, atol=0, rtol=0)  # the residual unchanged


@pytest.mark.parametrize("binary", [NONE, IN_PLACE, ADD])
def test_a_non_finite_input_gives_what_the_direct_convolution_gives(binary):
    """The transforms subtract inputs, so an infinity could come out NaN: such a call runs
    the direct convolution instead (its weights recovered from the transformed ones)."""
    torch.manual_seed(1)
    x, weight, bias = torch.randn(1, 16, 8, 8), torch.randn(16, 16, 3, 3), torch.randn(16)
    x[0, 3, 4, 4], x[0, 5, 1, 1] = float("inf"), float("-inf")
    conv = onednn_direct.WinogradConv(_geometry(1, 16, 8, 8, 16, 1), weight, bias, "relu",
                                      binary)
    residual = None if binary == NONE else \
        torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    want = _conv(x, weight, bias, 1, "relu", residual)
    got = conv(x) if residual is None else conv(x, residual.clone())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan())
    assert want.isinf().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-4, rtol=1e-4)
    clean = torch.randn(1, 16, 8, 8)                      # finite again: transformed again
    torch.testing.assert_close(conv(clean) if residual is None else conv(clean, residual.clone()),
                               _conv(clean, weight, bias, 1, "relu", residual),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("geometry, unary", [
    ((1, 8, 8, 8, 8, 3, 3, 1, 2, 2, 1, 1, 1, 1), None),     # stride 2
    ((1, 8, 8, 8, 8, 5, 5, 1, 1, 1, 2, 2, 1, 1), None),     # 5x5
    ((1, 8, 8, 8, 8, 3, 3, 2, 1, 1, 1, 1, 1, 1), None),     # two groups
    ((1, 8, 8, 8, 8, 3, 3, 1, 1, 1, 2, 2, 2, 2), None),     # dilated
    ((1, 8, 8, 8, 8, 3, 3, 1, 1, 1, 3, 3, 1, 1), None),     # a tile of padding only
    ((1, 8, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1), ("gelu", "none")),
])
def test_a_convolution_it_cannot_compute_is_refused(geometry, unary):
    weight = torch.randn(8, 8 // geometry[7], geometry[5], geometry[6])
    assert not onednn_direct.winograd_fits(geometry, unary)
    with pytest.raises(ValueError, match="no Winograd form"):
        onednn_direct.WinogradConv(geometry, weight, None, unary)


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
    assert "not its brgemm kernels" in out.stdout or "unavailable" in out.stdout


@offered_here
def test_the_library_offers_it_to_3x3_convolutions_of_stride_1_only():
    g = _block(stride=2)
    first, second = [n for n in g.nodes if n.op == "conv"]
    relu = next(n for n in g.nodes if n.op == "relu")
    assert "onednn-winograd" in library.forms(g, first, Epilogue(unary=relu, chain=(relu,)))
    assert "onednn-winograd" not in library.forms(g, second, Epilogue())


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
