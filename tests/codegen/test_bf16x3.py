"""precision="bf16x3": linear layers and convolutions from three bf16 parts of each operand
(codegen/onednn_direct.cpp, codegen/precision.py). Each check holds the split's error to
float32's own on the same float64 reference, and far below one bf16 rounding's, so a form
that silently computed in plain bf16 fails, and step names say the form ran."""
from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave import Options
from opweave.codegen import library, onednn_direct, precision

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="oneDNN's pip package is for x86-64 Linux")


def _needs_bf16_products():
    problem = onednn_direct.bf16x3_problem()
    if problem is not None:
        pytest.skip(f"oneDNN has no bf16 products on this CPU: {problem}")


def _max_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.double() - reference).abs().max())


def _as_accurate_as_float32(split: float, fp32: float, plain_bf16: float) -> None:
    """Within a few times float32's error (the six products sum in another order) and at
    least 100x below a single bf16 rounding of the operands."""
    assert split <= 4 * fp32 + 1e-7, (split, fp32)
    assert split * 100 < plain_bf16, (split, plain_bf16)


def test_three_parts_hold_a_float32_value():
    torch.manual_seed(0)
    x = torch.randn(10_000) * torch.logspace(-20, 20, 10_000)
    parts = onednn_direct.bf16_parts(x)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)
    assert float(((total - x.double()).abs() / x.double().abs()).max()) <= 2.0 ** -24
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    p0, p1, p2 = onednn_direct.bf16_parts(special)
    assert torch.equal(p0.float()[:2], special[:2]) and p0.float()[2].isnan()
    assert not p1.any() and not p2.any()        # nothing is left to the smaller parts


def test_a_weight_is_laid_in_its_slots_along_its_reduction_axis():
    w = torch.randn(4, 3, 2, 2)
    w0, w1, w2 = onednn_direct.bf16_parts(w)
    laid = onednn_direct.bf16x3_weight(w, axis=1)
    assert laid.shape == (4, 18, 2, 2)
    for slot, part in enumerate([w0, w1, w2, w0, w1, w0]):
        assert torch.equal(laid[:, 3 * slot:3 * slot + 3], part)
    w[0, 0, 0, 0] = float("inf")    # meets only the source's first part (slot 5)
    laid = onednn_direct.bf16x3_weight(w, axis=1)
    assert [float(laid[0, 3 * slot, 0, 0]) for slot in range(6)] == [0, 0, 0, 0, 0, float("inf")]


@pytest.mark.parametrize("geometry", [(7, 24, 40), (1, 300, 8), (128, 768, 96)])
@pytest.mark.parametrize("unary", [None, ("gelu", "none")])
@pytest.mark.parametrize("binary", [onednn_direct.NO_BINARY, onednn_direct.ADD])
def test_a_product_is_as_accurate_as_float32(geometry, unary, binary):
    _needs_bf16_products()
    m, k, n = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    residual = torch.randn(m, n) if binary == onednn_direct.ADD else None

    def finish(y):
        y = y if residual is None else y + residual.to(y.dtype)
        return y if unary is None else F.gelu(y)
    reference = finish(x.double() @ weight.double() + bias.double())
    plain = finish(x.bfloat16().double() @ weight.bfloat16().double() + bias.double())
    results = {}
    for parts in (1, 3):
        product = onednn_direct.DirectLinear(geometry, weight, bias, unary, binary, parts)
        results[parts] = product(x) if residual is None else product(x, residual.clone())
    _as_accurate_as_float32(_max_error(results[3], reference), _max_error(results[1], reference),
                            _max_error(plain, reference))


@pytest.mark.parametrize("geometry", [
    # N, C, H, W, O, K, stride, padding, dilation, groups
    (1, 16, 9, 9, 8, 3, 1, 1, 1, 1),
    (2, 8, 7, 7, 12, 1, 2, 0, 1, 1),
    (1, 8, 10, 10, 8, 3, 1, 2, 2, 2),
    (1, 3, 15, 15, 16, 7, 2, 3, 1, 1),
])
@pytest.mark.parametrize("binary", [onednn_direct.NO_BINARY, onednn_direct.SUM_IN_PLACE,
                                    onednn_direct.ADD])
def test_a_convolution_is_as_accurate_as_float32(geometry, binary):
    _needs_bf16_products()
    n, c, h, w, o, k, s, p, d, g = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, c, h, w), torch.randn(o, c // g, k, k), torch.randn(o)
    spec = (n, c, h, w, o, k, k, g, s, s, p, p, d, d)
    convs = {parts: onednn_direct.DirectConv(spec, weight, bias, "relu", binary, parts)
             for parts in (1, 3)}
    residual = None
    if binary != onednn_direct.NO_BINARY:
        residual = torch.randn(convs[3].out_shape).contiguous(memory_format=torch.channels_last)

    def reference(x, weight, bias):
        y = F.conv2d(x, weight, bias, s, p, d, g)
        return (y if residual is None else y + residual.to(y.dtype)).relu()
    want = reference(x.double(), weight.double(), bias.double())
    plain = reference(x.bfloat16().double(), weight.bfloat16().double(), bias.double())
    results = {}
    for parts, conv in convs.items():
        given = None if residual is None else residual.clone()
        results[parts] = conv(x) if given is None else conv(x, given)
        if binary == onednn_direct.SUM_IN_PLACE:
            assert results[parts].data_ptr() == given.data_ptr()   # into the residual itself
    _as_accurate_as_float32(_max_error(results[3], want), _max_error(results[1], want),
                            _max_error(plain, want))


def test_infinite_and_nan_values_come_out_as_in_float32():
    _needs_bf16_products()
    torch.manual_seed(0)
    # weights of both signs, some exactly bf16 (their smaller parts 0): inf times a part
    # that is 0, or of the other sign, would make NaN
    x, weight = torch.randn(5, 16), torch.randn(16, 8)
    weight[::3] = weight[::3].bfloat16().float()
    x[1, 3], x[2, 5], x[3, 0] = float("inf"), float("nan"), -float("inf")
    x[4] = x[4].bfloat16().float()
    weight[7, 2] = float("inf")
    want = onednn_direct.DirectLinear((5, 16, 8), weight, None)(x)
    got = onednn_direct.DirectLinear((5, 16, 8), weight, None, parts=3)(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[got.isinf()], want[want.isinf()])
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)


class _Net(nn.Module):
    """A convolution + ReLU, a grouped convolution with a residual, then linear layers with
    GELU and a residual: each kind of group bf16x3 splits."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.grouped = nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.fc1, self.fc2 = nn.Linear(16 * 8 * 8, 64), nn.Linear(64, 64)

    def forward(self, x):
        h = self.conv(x).relu()
        h = (self.grouped(h) + h).flatten(1)
        h = F.gelu(self.fc1(h))
        return self.fc2(h) + h


def _options(mode: str, native: str = "off") -> Options:
    # measure=False takes the bf16x3 form wherever it is offered (as the accuracy bench does)
    return Options(measure=False, deterministic=True, precision=mode, native=native,
                   tuning_db=None)


def _library_steps(compiled) -> list[str]:
    return [s.name for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps
            if s.kind == "library"]


def test_a_model_splits_every_product_and_keeps_float32s_accuracy():
    _needs_bf16_products()
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
        plain = copy.deepcopy(model).bfloat16()(x.bfloat16()).double()
        errors = {}
        for mode in ("fp32", "bf16x3"):
            compiled = opweave.compile(model, (x,), options=_options(mode))
            errors[mode] = _max_error(compiled(x), reference)
            names = _library_steps(compiled)
            assert len(names) == 4
            assert all(n.endswith("[bf16x3]") for n in names) == (mode == "bf16x3"), names
    _as_accurate_as_float32(errors["bf16x3"], errors["fp32"], _max_error(plain, reference))


def test_the_native_plan_replays_the_split_products():
    _needs_bf16_products()
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = opweave.compile(model, (torch.randn(2, 3, 8, 8),),
                               options=_options("bf16x3", native="wait"))
    executor = compiled.program.compiled_graphs[0].executor
    for _ in range(3):
        compiled(torch.randn(2, 3, 8, 8))
    assert executor.native.plan is not None, executor.native.describe()
    assert executor.native.counts[1] >= 4       # the four split products are raw calls
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


def test_its_choices_are_recorded_apart_and_offer_the_split_form():
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("lin")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.outputs = [linear(g, x, 8, 16, "fc")]
    anchor = next(n for n in g.nodes if n.op == "matmul")
    ep = Epilogue()
    assert "onednn-bf16x3" not in library.forms(g, anchor, ep)
    split = library.signature(g, anchor, ep, "bf16x3")
    if onednn_direct.bf16x3_problem() is None:
        assert split == library.signature(g, anchor, ep) + (("precision", "bf16x3"),)
        assert {"onednn", "onednn-direct", "onednn-bf16x3"} <= \
            set(library.forms(g, anchor, ep, precision="bf16x3"))
    else:  # no split form: the float32 forms' decision, shared with float32 compiles
        assert split == library.signature(g, anchor, ep)


def test_without_bf16_products_it_computes_in_float32_and_says_so(monkeypatch):
    monkeypatch.setattr(onednn_direct, "bf16x3_problem", lambda: "no bf16 products (test)")
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(2, 3, 8, 8)
    with pytest.warns(onednn_direct.OneDNNWarning,
                      match="'bf16x3' computes in float32 here: no bf16 products"):
        compiled = opweave.compile(model, (x,), options=_options("bf16x3"))
    assert not any("[bf16x3]" in n for n in _library_steps(compiled))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_cpu_without_avx512_has_no_bf16_products():
    """The probe, run where oneDNN is held to AVX2 (its ISA switch): oneDNN 3.2 makes no
    bf16 product there, and the probe says so instead of failing a compile."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    probe = subprocess.run(
        [sys.executable, "-c", "from opweave.codegen import onednn_direct as o; "
                               "print('problem:', o.bf16x3_problem())"],
        env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    assert "problem: oneDNN refused the linear" in probe.stdout, probe.stdout


def test_explain_counts_the_split_steps(monkeypatch):
    _needs_bf16_products()
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = str(opweave.explain(model, (torch.randn(4, 32),), graph_breaks=False,
                                   precision="bf16x3"))
    assert "precision: bf16x3: 2 of 2 linear/convolution steps from three bf16 parts" in text
    assert precision.units() in text


def test_training_is_refused():
    with pytest.raises(ValueError, match="applies to inference"):
        opweave.compile(_Net(), (torch.randn(2, 3, 8, 8),), train=True, precision="bf16x3")


def test_the_dynamo_backend_and_onnx_take_it(monkeypatch):
    _needs_bf16_products()
    from opweave.frontends import torch_dynamo

    from ..onnx.helpers import mlp, mlp_reference

    monkeypatch.setenv("OPWEAVE_MEASURE", "0")   # the split form wherever it is offered
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16)).eval(), \
        torch.randn(8, 64)
    torch._dynamo.reset()
    mark = torch_dynamo.compiled_graphs.mark()
    with torch.no_grad():
        got = torch.compile(model, backend="opweave", options={"precision": "bf16x3"})(x)
        torch.testing.assert_close(got, model(x), atol=1e-5, rtol=1e-5)
    steps = [s.name for p in torch_dynamo.compiled_graphs.since(mark)
             for g in p.compiled_graphs for s in g.executor.lowered_steps]
    assert sum(n.endswith("[bf16x3]") for n in steps) == 2, steps
    rows = torch.randn(16, 4).numpy()
    compiled = opweave.from_onnx(mlp(batch=16).SerializeToString(), precision="bf16x3")
    out = compiled(rows)
    out = out[0] if isinstance(out, (list, tuple)) else out
    torch.testing.assert_close(torch.as_tensor(out), torch.as_tensor(mlp_reference(rows)),
                               atol=1e-5, rtol=1e-5)
    graph, _ = compiled.compiled_for(rows)
    onnx_steps = [s.name for s in graph.executor.lowered_steps]
    assert any(n.endswith("[bf16x3]") for n in onnx_steps), onnx_steps
