"""Precision "bf16" on oneDNN's own library: the form "onednn-direct" with bf16 operands,
weights, results and residuals, the bias and epilogue in float32 (codegen/onednn_direct.py).
Each result is checked against float64 arithmetic on the same bf16-rounded operands, to
within one bf16 rounding of the result."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave import Options
from opweave.codegen import library, onednn_direct, precision

from .test_onednn_direct import CONV_BINARIES, CONV_GEOMETRIES, CONV_UNARIES, RELU6

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="oneDNN's pip package is for x86-64 Linux")
BF16 = torch.bfloat16


def _needs_bf16_primitives():
    problem = onednn_direct.bf16_problem()
    if problem is not None:
        pytest.skip(f"oneDNN's library has no bf16 primitives on this CPU: {problem}")


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """`t` as the bf16 form reads it, in float64."""
    return t.to(BF16).double()


def _epilogue(y: torch.Tensor, unary, residual) -> torch.Tensor:
    if residual is not None:
        y = y + _rounded(residual)
    if unary == "relu":
        return y.relu()
    if unary == "tanh":
        return y.tanh()
    if unary == RELU6:
        return y.clamp(0.0, 6.0)
    if isinstance(unary, tuple):
        return F.gelu(y, approximate=unary[1])
    return y


def _assert_one_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` (bf16) is `want` rounded once to bf16, give or take the float32 sum's order:
    within 2^-8 of each value, relative, and a bf16 step (not a float32 result)."""
    assert got.dtype == BF16
    tolerance = 2.0 ** -8 * want.abs() + 1e-3 * float(want.abs().max())
    assert bool(((got.double() - want).abs() <= tolerance).all()), \
        float((got.double() - want).abs().max())


@pytest.mark.parametrize("geometry", CONV_GEOMETRIES)
@pytest.mark.parametrize("unary", CONV_UNARIES)
@pytest.mark.parametrize("binary", CONV_BINARIES)
def test_a_convolution_computes_on_bf16_and_rounds_once(geometry, unary, binary):
    _needs_bf16_primitives()
    n, c, h, w, o, k, s, p, d, g = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, c, h, w), torch.randn(o, c // g, k, k), torch.randn(o)
    conv = onednn_direct.DirectConv((n, c, h, w, o, k, k, g, s, s, p, p, d, d), weight, bias,
                                    unary, binary, low=True)
    residual = None
    if binary != onednn_direct.NO_BINARY:
        residual = torch.randn(conv.out_shape).to(BF16).contiguous(
            memory_format=torch.channels_last)
    y = F.conv2d(_rounded(x), _rounded(weight), bias.double(), s, p, d, g)
    want = _epilogue(y, unary, residual)
    given = None if residual is None else residual.clone()
    got = conv(x.to(BF16)) if given is None else conv(x.to(BF16), given)
    assert got.is_contiguous(memory_format=torch.channels_last)
    _assert_one_rounding(got, want)
    if binary == onednn_direct.SUM_IN_PLACE:
        assert got.data_ptr() == given.data_ptr()      # added into the residual itself
    elif given is not None:
        assert torch.equal(given, residual)            # left untouched


@pytest.mark.parametrize("geometry", [(7, 24, 40), (1, 16, 8), (200, 64, 96)])
@pytest.mark.parametrize("unary", [None, "tanh", ("gelu", "none")])
@pytest.mark.parametrize("binary", [onednn_direct.NO_BINARY, onednn_direct.ADD])
def test_a_product_computes_on_bf16_and_rounds_once(geometry, unary, binary):
    _needs_bf16_primitives()
    m, k, n = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    product = onednn_direct.DirectLinear(geometry, weight, bias, unary, binary, low=True)
    residual = torch.randn(m, n).to(BF16) if binary == onednn_direct.ADD else None
    want = _epilogue(_rounded(x) @ _rounded(weight) + bias.double(), unary, residual)
    got = product(x.to(BF16)) if residual is None else product(x.to(BF16), residual)
    _assert_one_rounding(got, want)


def test_a_float32_operand_is_refused():
    _needs_bf16_primitives()
    product = onednn_direct.DirectLinear((2, 3, 4), torch.randn(3, 4), None, low=True)
    with pytest.raises(ValueError, match=r"linear built for \(2, 3\) bfloat16"):
        product(torch.randn(2, 3))


def test_bf16_and_three_parts_do_not_combine():
    with pytest.raises(ValueError, match="in bf16 or int8 from 1"):
        onednn_direct.DirectLinear((2, 3, 4), torch.randn(3, 4), None, parts=3, low=True)


class _Net(nn.Module):
    """A convolution with bias and ReLU, one summing its residual, a linear layer: every
    epilogue the bf16 direct forms take."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = F.relu(self.conv(y) + y)
        return self.fc(y.mean((2, 3)))


def _options(**extra) -> Options:
    # measure=False takes the direct form wherever it is offered
    return Options(measure=False, deterministic=True, precision="bf16", tuning_db=None,
                   **extra)


def _library_steps(compiled) -> list:
    return [s for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps
            if s.kind == "library"]


def test_a_model_runs_its_groups_on_it_and_the_native_plan_replays_them(monkeypatch):
    _needs_bf16_primitives()
    monkeypatch.setattr(library, "amx_products_on_torch", lambda: False)  # (on any CPU)
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        reference = model.double()(x.double())
        model.float()
        compiled = opweave.compile(model, (x,), options=_options(native="wait"))
        steps = _library_steps(compiled)
        assert [s.name for s in steps] == ["conv+relu [bf16]", "conv+add+relu [bf16]",
                                          "matmul+add [bf16]"]
        executor = compiled.program.compiled_graphs[0].executor
        for _ in range(3):
            got = compiled(x)
        assert executor.native.plan is not None, executor.native.describe()
        assert executor.native.counts[1] == 3      # the three groups (torch's forms: none)
        error = float((got.double() - reference).norm() / reference.norm())
        assert 1e-4 < error < 2e-2                 # bf16's error, not float32's
        assert got.dtype == torch.float32
        torch.testing.assert_close(compiled(x), got, rtol=0, atol=0)


@pytest.mark.skipif(not precision.bf16_supported(),
                    reason="torch's oneDNN has no bf16 on this CPU: bf16 computes in float32")
def test_its_records_say_whether_it_was_offered(monkeypatch):
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("lin")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.outputs = [linear(g, x, 8, 16, "fc")]
    anchor = next(n for n in g.nodes if n.op == "matmul")
    bias = g.outputs[0].producer
    ep = Epilogue(bias=bias, chain=(bias,))  # its result is the graph's output
    monkeypatch.setattr(library, "amx_products_on_torch", lambda: False)
    offered = library.signature(g, anchor, ep, "bf16")
    float32 = {"onednn", "onednn-direct"}
    if onednn_direct.bf16_problem() is None:
        assert set(library.forms(g, anchor, ep, precision="bf16")) == \
            float32 | {"onednn-bf16", "onednn-direct-bf16"}
        assert ("without", "onednn-direct-bf16") not in offered
        assert ("without", "onednn-direct") not in offered
    monkeypatch.setattr(library, "_bf16_direct_offered", lambda anchor: False)
    assert set(library.forms(g, anchor, ep, precision="bf16")) == float32 | {"onednn-bf16"}
    # a choice among fewer forms is another decision
    assert library.signature(g, anchor, ep, "bf16")[-2:] == \
        (("without", "onednn-direct-bf16"), ("precision", "bf16"))


def test_on_amx_products_are_not_offered_it_and_convolutions_are(monkeypatch):
    """On a CPU with AMX bf16 tiles a product's bf16 forms are torch's alone (oneDNN 3.2's
    AMX products ran slower in models than they measured), and a convolution's bf16 form
    is the direct one alone (torch's ran slower in models than they measured); their
    records say so."""
    _needs_bf16_primitives()
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("both")
    x = g.add_input("x", TensorType((1, 8, 6, 6), torch.float32))
    w = g.add_constant("w", torch.randn(8, 8, 3, 3))
    conv = g.add1("conv", [x, w], {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
                                   "groups": 1})
    rows = g.add1("reshape", [conv], {"shape": [8, 36]})
    g.outputs = [linear(g, rows, 36, 16, "fc")]
    product = next(n for n in g.nodes if n.op == "matmul")
    for amx in (False, True):
        flags = {"avx512_bf16", "amx_bf16"} if amx else {"avx512_bf16"}
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
        assert library.amx_products_on_torch() is amx
        product_forms = set(library.forms(g, product, Epilogue(), precision="bf16"))
        assert ("onednn-direct-bf16" in product_forms) is not amx
        assert "onednn-bf16" in product_forms
        record_key = library.signature(g, product, Epilogue(), "bf16")
        assert (("without", "onednn-direct-bf16") in record_key) is amx
        assert library.amx_convolutions_direct() is amx
        conv_forms = set(library.forms(g, conv.producer, Epilogue(), precision="bf16"))
        assert "onednn-direct-bf16" in conv_forms
        assert ("onednn-bf16" in conv_forms) is not amx
        assert {"onednn", "onednn-direct"} <= conv_forms  # the float32 forms stay
        conv_key = library.signature(g, conv.producer, Epilogue(), "bf16")
        assert (("without", "onednn-bf16") in conv_key) is amx


def test_a_cpu_without_avx512_has_no_bf16_primitives():
    """The probe, run where oneDNN is held to AVX2: oneDNN 3.2 makes no bf16 product there,
    and the probe says so; torch's bf16 forms then run alone."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    probe = subprocess.run(
        [sys.executable, "-c", "from opweave.codegen import onednn_direct as o; "
                               "print('problem:', o.bf16_problem())"],
        env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert "problem: oneDNN refused the linear" in probe.stdout, probe.stdout
