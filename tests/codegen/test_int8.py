"""precision="int8": post-training static quantization of library groups (codegen/int8.py).

Each int8 form is checked against its simulation in float64 (activations and weights
quantized and dequantized with the same scales, then the float computation): oneDNN's
int8 result may differ from it only by float32 rounding, so a wrong scale, zero point,
layout or epilogue fails. Whole models are checked against float64 within int8's error.
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave.codegen import (anchor_group, choice, int8, library, library_int8, onednn_direct,
                             quantize)
from opweave.options import Options
from opweave.partition.legality import Epilogue

pytestmark = pytest.mark.skipif(not anchor_group.supports(), reason="needs torch built with oneDNN")

INT8_REL_L2 = 5e-2  # per-tensor 8-bit activations, per-channel weights; fp32 is below 1e-5
FP32_REL_L2 = 1e-5


def _options(**kw) -> Options:
    # measure=False takes the precision's library form, whichever is faster on this machine
    return Options(measure=False, deterministic=True, precision="int8", native="off", **kw)


@pytest.fixture(params=["direct", "torch"])
def int8_form(request, monkeypatch):
    """Runs a test on each int8 form of its groups: on oneDNN's own primitives
    ("onednn-int8-direct", which measure=False takes where it is offered: the test fails
    if none ran, or if any group built torch's int8 form instead) and on torch's int8 ops
    ("onednn-int8")."""
    if request.param == "torch":
        monkeypatch.setattr(library_int8, "int8_direct_offered", lambda anchor, ep: False)
        yield request.param
        return
    problem = onednn_direct.int8_problem()
    if problem is not None:
        pytest.skip(f"oneDNN's library has no int8 primitives on this CPU: {problem}")

    def refusing(make):
        def made(*args, **kwargs):
            make(*args, **kwargs)

            def build(*qparams):
                raise AssertionError("torch's int8 form was built where the direct one runs")
            return build
        return made
    for name in ("_int8_conv", "_int8_linear", "_int8_linear_dynamic"):
        monkeypatch.setattr(library_int8, name, refusing(getattr(library_int8, name)))
    sources = []
    run = onednn_direct.run_recorded

    def counted(runner, tensors):
        sources.append(tensors[1].dtype)
        run(runner, tensors)
    monkeypatch.setattr(onednn_direct, "run_recorded", counted)
    yield request.param
    assert torch.uint8 in sources, "no direct int8 primitive ran"


def _rel_l2(got, reference) -> float:
    return float((got.double() - reference.double()).norm() / reference.double().norm())


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model in float64 (a copy: the model itself stays float32; integer inputs as
    they are)."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double() if x.is_floating_point() else x)


def _steps(compiled):
    return [s for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps]


def _fake_quant(x: torch.Tensor, qparams) -> torch.Tensor:
    scale, zp = qparams
    q = torch.clamp(torch.round(x.double() / scale) + zp, 0, quantize.activation_qmax())
    return (q - zp) * scale


def _fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize.weight_qparams(w)
    return q.double() * scale.double().reshape((-1,) + (1,) * (w.dim() - 1))


# -- quantization parameters ---------------------------------------------------------------

def test_activation_ranges_map_onto_uint8_with_zero_exact():
    scale, zp = quantize.activation_qparams(-1.0, 3.0, 255)
    assert scale == pytest.approx(4.0 / 255) and zp == 64
    assert quantize.activation_qparams(0.5, 2.0, 255) == (pytest.approx(2.0 / 255), 0)  # holds 0
    assert quantize.activation_qparams(-2.0, -1.0, 127) == (pytest.approx(2.0 / 127), 127)
    assert quantize.activation_qparams(0.0, 0.0, 255) == (1.0, 0)
    with pytest.raises(ValueError, match="non-finite"):
        quantize.activation_qparams(float("-inf"), 1.0, 255)


def test_weights_are_quantized_per_output_channel():
    w = torch.randn(6, 4, 3, 3) * torch.arange(1, 7).reshape(6, 1, 1, 1)
    w[2] = 0.0
    q, scale = quantize.weight_qparams(w)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert scale[2] == 1.0 and not q[2].any()
    err = (_fake_quant_weight(w) - w.double()).abs().amax(dim=(1, 2, 3))
    assert (err <= scale.double() / 2 + 1e-7).all()
    assert (q.abs().amax(dim=(1, 2, 3))[[0, 1, 3, 4, 5]] == 127).all()


@pytest.mark.parametrize("layout", ["rows", "channels_last"])
def test_the_cpp_quantizer_matches_the_formula(layout):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 9, 9) * 3
    x.view(-1)[:4] = torch.tensor([0.5, 1.5, -0.5, 1e9])  # ties round to even; clamped
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    scale, zp = 0.05, 100
    got = quantize.Quantizer(scale, zp)(x)
    want = torch.clamp(torch.round(x * (1 / scale)) + zp, 0, quantize.activation_qmax()).to(torch.uint8)
    assert got.dtype == torch.uint8 and got.stride() == x.stride()
    assert torch.equal(got, want)


def test_units_and_the_activation_range_follow_the_cpus_flags():
    line = "processor\t: 0\nflags\t\t: fpu sse avx2 fma {}\nbugs\t\t: none\n"
    assert not quantize.has_int8_units(line.format(""))
    assert int8.units(line.format("")).startswith("no int8 dot-product units: 7-bit")
    assert quantize.has_int8_units(line.format("avx512f avx512_vnni"))
    assert int8.units(line.format("avx512_vnni")).startswith("VNNI")
    assert int8.units(line.format("amx_int8 amx_tile")) == "AMX int8 tiles"
    assert quantize.activation_qmax() == (255 if quantize.has_int8_units() else 127)


# -- each int8 form against its float64 simulation -----------------------------------------

def _check_group(model: nn.Module, x: torch.Tensor, simulate, rel: float = 1e-5):
    """Compile `model` (one int8 group) in int8; its output must match `simulate(xq, model)`
    (the float64 computation on the dequantized input) to float32 rounding."""
    model = model.eval()
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
        got = compiled(x)
        (group,) = [s for s in _steps(compiled) if s.precision == "int8"]
        want = simulate(_fake_quant(x, group.fn.qparams), model)
        in_fp32 = model(x)
    assert got.dtype == torch.float32
    assert _rel_l2(got, want) < rel, _rel_l2(got, want)
    assert _rel_l2(got, in_fp32) > 10 * FP32_REL_L2  # int8 did run
    return group


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "gelu-tanh", "tanh"])
def test_a_linear_group_and_its_activation(act, int8_form):
    torch.manual_seed(0)
    fns = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh,
           "gelu-tanh": lambda t: F.gelu(t, approximate="tanh")}

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(96, 80)

        def forward(self, x):
            return fns[act](self.fc(x))

    def simulate(xq, m):
        w, b = _fake_quant_weight(m.fc.weight), m.fc.bias.double()
        return fns[act](xq @ w.t() + b)
    group = _check_group(Lin(), torch.randn(64, 96), simulate)
    assert group.name.endswith("[int8]")


def test_a_linear_group_with_a_residual_add(int8_form):
    torch.manual_seed(0)

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(x) + x * 2

    def simulate(xq, m):
        x = simulate.x.double()
        return xq @ _fake_quant_weight(m.fc.weight).t() + m.fc.bias.double() + 2 * x
    simulate.x = torch.randn(32, 64)
    _check_group(Res(), simulate.x, simulate)


@pytest.mark.parametrize("kind", ["3x3", "strided-1x1", "depthwise", "1d"])
def test_a_convolution_group(kind, int8_form):
    torch.manual_seed(0)
    if kind == "1d":
        conv, x = nn.Conv1d(16, 24, 5, padding=2), torch.randn(1, 16, 40)
    else:
        conv = {"3x3": nn.Conv2d(16, 24, 3, padding=1),
                "strided-1x1": nn.Conv2d(16, 24, 1, stride=2),
                "depthwise": nn.Conv2d(16, 16, 3, padding=1, groups=16)}[kind]
        x = torch.randn(1, 16, 14, 14)
    model = nn.Sequential(conv, nn.ReLU())

    def simulate(xq, m):
        c = m[0]
        fn = F.conv1d if kind == "1d" else F.conv2d
        return F.relu(fn(xq, _fake_quant_weight(c.weight), c.bias.double(), c.stride,
                         c.padding, c.dilation, c.groups))
    _check_group(model, x, simulate)


@pytest.mark.parametrize("residual_read_later", [False, True])
def test_a_convolution_with_a_residual_add(residual_read_later, int8_form):
    """conv + residual + ReLU sums into the residual in place only where nothing reads
    the residual afterwards."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(8, 8, 3, padding=1)
            self.b = nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            r = torch.tanh(x) * 2
            y = F.relu(self.b(F.relu(self.a(x))) + r)
            return y + r if residual_read_later else y

    model = Block().eval()
    x = torch.randn(1, 8, 12, 12)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
        got, reference = compiled(x), _reference(model, x)
        again = compiled(x)
    steps = _steps(compiled)
    assert sum(s.precision == "int8" for s in steps) == 2
    into = [s for s in steps if "(into its residual)" in s.name]
    assert bool(into) != residual_read_later
    assert _rel_l2(got, reference) < INT8_REL_L2
    assert torch.equal(got, again)  # the residual was not left changed between calls


def test_a_residual_of_codes_read_later_is_summed_into_a_copy(int8_form):
    """The stem writes codes that three int8 groups read: conv a as its input, conv b as
    the residual it sums into (as codes: b's result is read only by conv d, so it writes
    codes too), conv c as its input after that sum; so b sums into a copy of the codes,
    and c still reads them unchanged."""
    torch.manual_seed(0)

    class Fork(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
            self.c, self.d = nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            s = F.relu(self.stem(x))
            y = F.relu(self.b(F.relu(self.a(s))) + s)
            z = F.relu(self.c(s))
            return F.relu(self.d(y)).mean(dim=(2, 3)) + z.mean(dim=(2, 3))

    model, x = Fork().eval(), torch.randn(1, 3, 10, 10)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
        got, again, reference = compiled(x), compiled(x), _reference(model, x)
    (summing,) = [s for s in _steps(compiled) if s.precision == "int8" and s.fn.sums]
    assert summing.fn.accum_in_uint8 and "(into its residual)" not in summing.name
    assert torch.equal(got, again)  # the stem's codes were not summed into
    assert 10 * FP32_REL_L2 < _rel_l2(got, reference) < INT8_REL_L2


@pytest.mark.parametrize("failure", ["reference-only", "refused"])
def test_a_group_without_a_direct_int8_primitive_runs_torchs_int8_form(monkeypatch, failure):
    """Where oneDNN has only its reference kernel for a group, or refuses its primitive,
    the group builds torch's int8 form instead, said once; it stays int8."""
    if onednn_direct.int8_problem() is not None:
        pytest.skip(f"oneDNN's library has no int8 primitives: {onednn_direct.int8_problem()}")
    error = onednn_direct.ReferenceOnly("only the reference") if failure == "reference-only" \
        else RuntimeError("oneDNN refused it")

    def fail(self):
        raise error
    monkeypatch.setattr(onednn_direct.DirectConv, "implementation", fail)
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled = opweave.compile(model, (x,), options=_options())
        got = compiled(x)
    said = [str(w.message) for w in caught if issubclass(w.category, onednn_direct.OneDNNWarning)]
    assert said and all("has no direct int8 form" in m and "torch's oneDNN int8 form runs "
                        "instead" in m for m in said)
    assert sum(s.precision == "int8" for s in _steps(compiled)) == 3
    assert 10 * FP32_REL_L2 < _rel_l2(got, _reference(model, x)) < INT8_REL_L2


def test_the_key_says_where_the_direct_int8_form_is_not_offered(monkeypatch):
    """A choice made without the form is another decision: its record must not answer for
    a machine that has it (nor the other way round)."""
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
    graph = compiled.program.compiled_graphs[0].executor.graph
    anchor = next(n for n in graph.nodes if n.op == "conv")
    offered = library.signature(graph, anchor, Epilogue(), "int8")
    monkeypatch.setattr(onednn_direct, "int8_problem", lambda: "no int8 primitives here")
    withheld = library.signature(graph, anchor, Epilogue(), "int8")
    assert ("without", "onednn-int8-direct") in withheld
    assert withheld != offered and ("without", "onednn-int8-direct") not in offered


# -- calibration ---------------------------------------------------------------------------

def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 10)).eval()


def test_a_cnn_runs_in_int8_within_its_error_and_requantizes_between_groups(int8_form):
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
        got, reference = compiled(x), _reference(model, x)
    steps = [s for s in _steps(compiled) if s.precision == "int8"]
    assert len(steps) == 3
    # conv -> conv writes the second's uint8 codes; the graph's output stays float32
    assert steps[0].fn.requantize == steps[1].fn.qparams
    assert steps[1].fn.requantize == steps[2].fn.qparams  # through the flattening view
    assert steps[2].fn.requantize is None and got.dtype == torch.float32
    assert 10 * FP32_REL_L2 < _rel_l2(got, reference) < INT8_REL_L2


def test_calibration_batches_set_the_ranges_and_cover_what_they_saw():
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    batches = [torch.randn(1, 3, 8, 8) * 4 for _ in range(3)]
    with torch.no_grad():
        on_example = opweave.compile(model, (x,), options=_options())
        on_batches = opweave.compile(model, (x,), options=_options(), calibration=batches)
        first = lambda c: next(s.fn for s in _steps(c) if s.precision == "int8")  # noqa: E731
        assert first(on_example).qparams == quantize.activation_qparams(
            float(x.min()), float(x.max()), quantize.activation_qmax())
        low = min(float(b.min()) for b in batches)
        high = max(float(b.max()) for b in batches)
        assert first(on_batches).qparams == quantize.activation_qparams(
            low, high, quantize.activation_qmax())
        # the round trip: what calibration saw comes back within half a step, unclipped
        scale = first(on_batches).qparams[0]
        for b in batches:
            assert (_fake_quant(b, first(on_batches).qparams) - b.double()).abs().max() \
                <= scale / 2 + 1e-6
        # a batch far outside the range is clipped: its error grows past half a step
        wide = batches[0] * 10
        assert (_fake_quant(wide, first(on_batches).qparams) - wide.double()).abs().max() \
            > 10 * scale
        torch.testing.assert_close(on_batches(x), model(x), rtol=0, atol=0.2)


def test_calibration_batches_are_checked():
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="calibration batch 1 of Sequential is not a call like "
                                         r"the example: .*shape \[2, 3, 8, 8\]"):
        opweave.compile(model, (x,), options=_options(), calibration=[x, torch.randn(2, 3, 8, 8)])
    with pytest.raises(ValueError, match="calibration= applies to .*precision='int8'"):
        opweave.compile(model, (x,), calibration=[x])
    with pytest.raises(ValueError, match="holds no batch"):
        opweave.compile(model, (x,), options=_options(), calibration=[])
    with pytest.raises(TypeError, match="calibration batch 0 is a str"):
        opweave.compile(model, (x,), options=_options(), calibration=["x"])


def test_without_calibration_the_first_call_calibrates_and_every_call_is_int8(monkeypatch):
    """torch.compile's graphs calibrate on their first call; it already returns int8
    results, the same as later calls."""
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="opweave", options={"precision": "int8"})
    with torch.no_grad():
        first, second = compiled(x), compiled(x)
        reference = _reference(model, x)
    assert torch.equal(first, second)
    assert 10 * FP32_REL_L2 < _rel_l2(first, reference) < INT8_REL_L2


def test_the_native_plan_replays_the_int8_graph(int8_form):
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    options = Options(measure=False, deterministic=True, precision="int8", native="wait")
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=options)
        python = compiled(x)
        for _ in range(3):  # recorded at the second call, checked at the third
            compiled(x)
        (graph,) = compiled.program.compiled_graphs
        assert graph.executor.native.plan is not None, graph.executor.native.reason
        replayed = compiled(x)  # by the plan
    assert graph.executor.native.counts[1] >= 1  # the quantizer kernel was recorded
    assert torch.equal(python, replayed)


def test_a_failed_calibration_leaves_the_graph_in_float32_with_one_warning():
    """A calibration batch with an infinity gives no scale: no group switches to int8
    (a half-switched graph would hand codes to groups expecting floats)."""
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    broken = x.clone()
    broken[0, 0, 0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled = opweave.compile(model, (x,), options=_options(), calibration=[broken])
        got = compiled(x)
        again = compiled(x)
    (message,) = [str(w.message) for w in caught if issubclass(w.category, int8.Int8Warning)]
    assert message.startswith("opweave: int8 calibration failed (ValueError: calibration saw "
                              "a non-finite value (range -")
    assert message.endswith("..inf)); the 3 int8 groups of this graph compute in float32")
    assert _rel_l2(got, _reference(model, x)) < FP32_REL_L2
    assert torch.equal(got, again)


def test_without_int8_units_no_result_travels_as_codes(monkeypatch):
    """With 7-bit activations, oneDNN's requantized outputs would use all 8 bits: every
    group then quantizes its own input, within 7 bits."""
    monkeypatch.setattr(quantize, "activation_qmax", lambda: 127)
    monkeypatch.setattr(int8, "activation_qmax", lambda: 127)
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options())
        got = compiled(x)
    groups = [s.fn for s in _steps(compiled) if s.precision == "int8"]
    assert len(groups) == 3 and all(g.requantize is None for g in groups)
    assert all(g.qparams == quantize.activation_qparams(g.input_range.low, g.input_range.high,
                                                        127) for g in groups)
    assert 10 * FP32_REL_L2 < _rel_l2(got, _reference(model, x)) < INT8_REL_L2


def test_onnx_models_take_calibration_batches():
    from ..onnx.helpers import mlp, mlp_reference

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    batches = [[rng.standard_normal((16, 4)).astype(np.float32)] for _ in range(3)]
    model = opweave.from_onnx(mlp().SerializeToString(), options=_options(),
                              calibration=batches)
    got = np.asarray(model(x)[0], np.float64)
    ref = mlp_reference(x.astype(np.float64))
    assert 10 * FP32_REL_L2 < np.linalg.norm(got - ref) / np.linalg.norm(ref) < INT8_REL_L2
    with pytest.raises(ValueError, match="calibration= applies to .*precision='int8'"):
        opweave.from_onnx(mlp().SerializeToString(), calibration=batches)
    with pytest.warns(int8.Int8Warning, match="these batches calibrated nothing"):
        model.calibrate(batches)  # scales are fixed once


def test_explain_says_how_many_steps_run_in_int8(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    text = str(opweave.explain(_cnn(), (torch.randn(1, 3, 8, 8),), graph_breaks=False,
                               precision="int8"))
    assert "precision: int8: 3 of 3 linear/convolution steps in int8, 2 of them writing uint8" \
        in text
    assert int8.units() in text


def test_int8_choices_are_recorded_apart_and_fusion_off_says_it_stays_float32():
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("lin")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.outputs = [linear(g, x, 8, 16, "fc")]
    anchor = next(n for n in g.nodes if n.op == "matmul")
    assert library.signature(g, anchor, Epilogue()) != \
        library.signature(g, anchor, Epilogue(), "int8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = opweave.compile(_cnn(), (torch.randn(1, 3, 8, 8),),
                                   options=_options(fusion="off"))
    assert any("computes in float32: int8 runs on fused library groups" in str(w.message)
               for w in caught)
    assert not any(s.precision == "int8" for s in compiled.program.compiled_graphs[0]
                   .executor.lowered_steps or [])


# -- dynamic quantization of linear layers -------------------------------------------------

def _own_range(x: torch.Tensor):
    return quantize.activation_qparams(float(x.min()), float(x.max()), quantize.activation_qmax())


def test_the_dynamic_quantizer_takes_each_calls_range():
    torch.manual_seed(0)
    to_codes = quantize.DynamicQuantizer()
    for x in (torch.randn(33, 70), torch.rand(33, 70) * 9 + 1, -torch.rand(8, 5)):
        codes, scale, zero_point = to_codes(x)
        want_scale, want_zp = _own_range(x)
        assert float(scale) == pytest.approx(want_scale, rel=1e-6) and int(zero_point) == want_zp
        want = torch.clamp(torch.round(x * (1 / float(scale))) + want_zp, 0,
                           quantize.activation_qmax()).to(torch.uint8)
        assert (codes.int() - want.int()).abs().max() <= 1  # x / s vs x * (1 / s)
        # a strided view takes the torch ops' path: the same codes
        slow = to_codes(x.t().contiguous().t())
        assert float(slow[1]) == pytest.approx(float(scale), rel=1e-6)
        assert (slow[0].int() - codes.int()).abs().max() <= 1


def test_int8_dynamic_quantizes_linear_layers_at_each_calls_range_also_when_replayed(int8_form):
    """The native plan replays the quantizer kernel, which measures every call's range: a
    call with inputs 10x the recorded one's is quantized at its own scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 32)).eval()
    options = Options(measure=False, deterministic=True, precision="int8-dynamic",
                      native="wait")
    x = torch.randn(16, 48)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=options)
        for _ in range(4):  # recorded at the second call, checked at the third
            compiled(x)
        (graph,) = compiled.program.compiled_graphs
        assert graph.executor.native.plan is not None, graph.executor.native.reason
        wide = x * 10  # run by the plan
        got = compiled(wide)
        first = F.gelu(_fake_quant(wide, _own_range(wide)) @
                       _fake_quant_weight(model[0].weight).t() + model[0].bias.double())
        want = _fake_quant(first, _own_range(first)) @ \
            _fake_quant_weight(model[2].weight).t() + model[2].bias.double()
    assert _rel_l2(got, want) < 1e-4
    steps = [s.name for s in graph.executor.lowered_steps if s.precision == "int8-dynamic"]
    assert len(steps) == 2 and all(n.endswith("[int8-dynamic]") for n in steps)


def test_int8_dynamic_leaves_convolutions_in_float32(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    text = str(opweave.explain(model, (x,), graph_breaks=False, precision="int8-dynamic"))
    assert "precision: int8-dynamic: 1 of 1 linear steps in int8" in text
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), precision="int8-dynamic")
        err = _rel_l2(compiled(x), _reference(model, x))
    assert 10 * FP32_REL_L2 < err < INT8_REL_L2
    with pytest.raises(ValueError, match="calibration= applies to .*precision='int8'"):
        opweave.compile(model, (x,), precision="int8-dynamic", calibration=[x])


def test_a_transposed_activation_is_quantized_in_its_own_layout():
    """XML-CNN's convolutions read the embedding's [N, L, C] output as [N, C, L]: dense,
    neither contiguous nor channels-last. The kernel reads it as it lies."""
    x = torch.randn(1, 50, 30).transpose(1, 2)
    assert quantize._dense(x) and not x.is_contiguous()
    assert not quantize._dense(torch.randn(8, 8)[:, :4]) and quantize._dense(torch.randn(1, 4, 1, 3))
    got = quantize.Quantizer(0.02, 128)(x)
    assert got.stride() == x.stride()
    want = torch.clamp(torch.round(x * (1 / 0.02)) + 128, 0, quantize.activation_qmax())
    assert torch.equal(got, want.to(torch.uint8))


class _TwoBlocks(nn.Module):
    """A stem and its max pooling, a block summing into its input, a block summing into a
    1x1 shortcut, then pooling: ResNet's pattern within a stage and across a stage
    boundary."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a1, self.a2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.b1, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.shortcut = nn.Conv2d(8, 16, 1)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = F.relu(self.a2(F.relu(self.a1(x))) + x)
        x = F.relu(self.b2(F.relu(self.b1(x))) + self.shortcut(x))
        return x.mean(dim=(2, 3))


def test_residual_sums_run_on_uint8_codes_where_their_result_stays_int8(int8_form):
    """Block a's output feeds only int8 groups, so it sums into its residual (the stem's
    pooled output) as uint8 codes and writes codes; block b's output goes to the average
    pooling, so it writes float32 and so must its residual (the shortcut's output). The
    stem writes codes through the max pooling, which pools them."""
    torch.manual_seed(0)
    model, x = _TwoBlocks().eval(), torch.randn(1, 3, 10, 10)
    options = Options(measure=False, deterministic=True, precision="int8", native="wait")
    pooled = []
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=options)  # calibrates
        (graph,) = compiled.program.compiled_graphs
        (pool,) = [s.fn for s in graph.executor.lowered_steps
                   if isinstance(s.fn, int8.CodesMaxPool)]
        pool.codes = _Recording(pool.codes, pooled)
        python = compiled(x)
        for _ in range(3):
            replayed = compiled(x)
    groups = [s.fn for s in graph.executor.lowered_steps if s.precision == "int8"]
    stem, a1, a2, b1, b2, shortcut = (next(s.fn for s in graph.executor.lowered_steps
                                           if s.precision == "int8" and s.nodes[0] is n)
                                      for n in _conv_nodes(graph, 6))
    assert len(groups) == 6
    assert stem.requantize == a1.qparams == a2.accum_qparams
    assert a2.sums and a2.accum_in_uint8 and a2.requantize == b1.qparams == shortcut.qparams
    assert b1.requantize == b2.qparams
    assert shortcut.requantize is None
    assert b2.sums and not b2.accum_in_uint8 and b2.requantize is None
    assert pooled and all(t.dtype == torch.uint8 for t in pooled)  # the stem's codes
    assert graph.executor.native.plan is not None, graph.executor.native.reason
    assert torch.equal(python, replayed)
    assert 10 * FP32_REL_L2 < _rel_l2(python, _reference(model, x)) < INT8_REL_L2


class _Recording:
    def __init__(self, fn, seen):
        self.fn, self.seen = fn, seen

    def __call__(self, x):
        self.seen.append(x)
        return self.fn(x)


def test_max_pooling_codes_matches_pooling_the_values():
    for shape, kernel, stride, padding, dilation in (
            ((1, 16, 11, 11), (3, 3), (2, 2), (1, 1), (1, 1)),
            ((2, 5, 9, 7), (2, 3), (1, 2), (1, 1), (2, 1)),
            ((1, 300, 6, 6), (2, 2), [], (0, 0), (1, 1))):
        codes = torch.randint(0, 256, shape, dtype=torch.uint8)
        got = quantize.MaxPoolCodes(kernel, stride, padding, dilation)(codes)
        want = F.max_pool2d(codes.float(), kernel, stride or kernel, padding, dilation)
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(got.float(), want)
    values = torch.randn(1, 8, 9, 9)
    to_codes = quantize.Quantizer(0.02, 100)
    assert torch.equal(quantize.MaxPoolCodes((3, 3), (2, 2), (1, 1), (1, 1))(to_codes(values)),
                       to_codes(F.max_pool2d(values, 3, 2, 1)))


def test_int8_forms_are_measured_on_codes_where_their_operands_arrive_as_codes():
    """A convolution reading another's (ReLU'd or summed) result reads codes once
    calibrated, so its int8 form is timed on codes, not on float32 it would quantize;
    the stem reads the graph's input, a linear layer after a layer norm its float32."""
    model, x = _TwoBlocks().eval(), torch.randn(1, 3, 10, 10)
    options = Options(measure=False, deterministic=True, precision="int8", native="off")
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=options)
    (graph,) = compiled.program.compiled_graphs
    stem, a1, a2, b1, b2, shortcut = _conv_nodes(graph, 6)
    assert not int8.arrives_as_codes(graph.graph, stem.inputs[0])
    assert all(int8.arrives_as_codes(graph.graph, n.inputs[0])
               for n in (a1, a2, b1, b2, shortcut))
    norm = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)).eval()
    with torch.no_grad():
        compiled = opweave.compile(norm, (torch.randn(4, 8),), options=options)
    ir = compiled.program.compiled_graphs[0].graph
    first, second = [n for n in ir.nodes if n.op == "matmul"]
    assert not int8.arrives_as_codes(ir, first.inputs[0])
    assert not int8.arrives_as_codes(ir, second.inputs[0])  # a layer norm's result
    residual = nn.Sequential(_Residual(nn.Linear(8, 8)), nn.Linear(8, 8)).eval()
    with torch.no_grad():
        compiled = opweave.compile(residual, (torch.randn(4, 8),), options=options)
    ir = compiled.program.compiled_graphs[0].graph
    last = [n for n in ir.nodes if n.op == "matmul"][-1]
    assert not int8.arrives_as_codes(ir, last.inputs[0])  # a linear layer's sum writes float32

    built = []

    def build(scale, zero_point, out, accum):
        built.append((out, accum))
        return lambda x, residual: [residual]

    group = int8.Int8Group(build, None, requantizes=True, sums=True, codes_in=True,
                           codes_accum=True)
    image = torch.randn(1, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    codes, residual = group.measured_args([image, torch.randn(1, 4, 3, 3)])
    assert codes.dtype == residual.dtype == torch.uint8
    assert codes.is_contiguous(memory_format=torch.channels_last)
    group(codes, residual)       # a residual of codes: built to write codes
    group(image, torch.randn(1, 4, 3, 3))  # float32 operands: built to write float32
    provisional = int8._PROVISIONAL
    assert built == [(provisional, provisional), (None, None)]

    seen = {}
    candidates = {"plain": lambda a: seen.setdefault("plain", a.dtype),
                  "int8": _Measured(lambda a: seen.setdefault("int8", a.dtype))}
    choice.measure(candidates, [torch.randn(2, 2)], rounds=1)
    assert seen == {"plain": torch.float32, "int8": torch.uint8}


def test_float32_is_kept_only_where_it_beats_int8_by_the_margin():
    close = {"reference": [1.0, 0.95], "onednn": [0.93], "onednn-int8": [1.0, 1.02]}
    assert choice._preferring_int8(close) == "onednn-int8"  # 7% slower: int8 kept
    far = {"reference": [1.0], "onednn": [0.8], "onednn-int8": [0.95, 0.9]}
    assert choice._preferring_int8(far) == "onednn"          # 12.5% slower: float32
    plain = {"reference": [1.0], "onednn": [0.99]}
    assert choice._preferring_int8(plain) == "onednn"        # no int8 form: the fastest


def test_the_direct_int8_form_is_kept_within_its_margin_of_another_int8_form():
    near = {"onednn": [1.0], "onednn-int8": [0.50], "onednn-int8-direct": [0.51]}
    assert choice._preferring_int8(near) == "onednn-int8-direct"  # 2% slower: kept
    far = {"onednn": [1.0], "onednn-int8": [0.50], "onednn-int8-direct": [0.55]}
    assert choice._preferring_int8(far) == "onednn-int8"          # 10% slower: not
    # never for float32's sake: float32 far faster than every int8 form stays float32
    slow = {"onednn": [0.5], "onednn-int8": [0.9], "onednn-int8-direct": [0.91]}
    assert choice._preferring_int8(slow) == "onednn"
    # the margins do not add up: within 3% of torch's int8 form but 12% behind float32
    behind = {"onednn": [1.0], "onednn-int8": [1.09], "onednn-int8-direct": [1.12]}
    assert choice._preferring_int8(behind) == "onednn-int8"


class _Residual(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + x


class _Measured:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def measured_args(self, args):
        return [a.to(torch.uint8) for a in args]


def _conv_nodes(graph, count):
    """The convolution nodes of a compiled graph's steps in the order of the model's
    layers (stem, a1, a2, b1, b2, shortcut): by their weight's shape and the step order."""
    convs = [s.nodes[0] for s in graph.executor.lowered_steps
             if s.nodes and s.nodes[0].op == "conv"]
    assert len(convs) == count
    shortcut = next(n for n in convs if n.inputs[1].type.shape[2:] == (1, 1))
    rest = [n for n in convs if n is not shortcut]
    return (*rest, shortcut)


def test_an_embedding_read_only_by_int8_groups_gathers_codes():
    """XML-CNN's pattern: rows of a constant table, transposed, into 1-D convolutions.
    Once calibrated, the table is quantized at the convolutions' scale and the gather
    reads codes, the same codes quantizing the gathered rows gives."""
    torch.manual_seed(0)

    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(100, 24)
            self.convs = nn.ModuleList(nn.Conv1d(24, 8, w) for w in (2, 3))

        def forward(self, tokens):
            x = self.embedding(tokens).transpose(1, 2)
            return torch.cat([F.relu(c(x)).amax(dim=2) for c in self.convs], dim=1)

    model, tokens = Text().eval(), torch.randint(0, 100, (1, 40))
    options = Options(measure=False, deterministic=True, precision="int8", native="wait")
    with torch.no_grad():
        compiled = opweave.compile(model, (tokens,), options=options)
        python = compiled(tokens)
        for _ in range(3):
            compiled(tokens)
        (graph,) = compiled.program.compiled_graphs
        assert graph.executor.native.plan is not None, graph.executor.native.reason
        replayed = compiled(tokens)
        reference = _reference(model, tokens)
        (gather,) = [s.fn for s in graph.executor.lowered_steps
                     if isinstance(s.fn, int8.CodeGather)]
        convs = [s.fn for s in graph.executor.lowered_steps if s.precision == "int8"]
        assert len(convs) == 2 and convs[0].qparams == convs[1].qparams
        # so their int8 forms were measured on codes
        assert all(int8.arrives_as_codes(graph.graph, s.nodes[0].inputs[0])
                   for s in graph.executor.lowered_steps if s.precision == "int8")
        index = tokens.reshape(-1)
        (codes,) = gather(model.embedding.weight, index)
        rows = model.embedding.weight[index]
    assert codes.dtype == torch.uint8
    assert torch.equal(codes, quantize.Quantizer(*convs[0].qparams)(rows))
    assert torch.equal(python, replayed)
    assert 10 * FP32_REL_L2 < _rel_l2(python, reference) < INT8_REL_L2


def test_calls_inside_opweave_calibrating_calibrate_a_torch_compile_model(monkeypatch):
    """Every call inside the context counts toward the ranges; scales are fixed on
    leaving it, so the calls after it run in int8 at the ranges of all of them."""
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    model = _cnn()
    batches = [torch.randn(1, 3, 8, 8) * s for s in (1.0, 3.0, 0.5)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="opweave", options={"precision": "int8"})
    with torch.no_grad():
        with opweave.calibrating() as reached:
            inside = [compiled(b) for b in batches]
        assert len(reached) == 1
        after = compiled(batches[1])  # the widest batch: the one the ranges fit best
        reference = _reference(model, batches[1])
    torch.testing.assert_close(inside[0], model(batches[0]), rtol=1e-5, atol=1e-5)  # float32
    assert 10 * FP32_REL_L2 < _rel_l2(after, reference) < INT8_REL_L2
    (calibration,) = reached.values()
    first = calibration.groups[0]
    low = min(float(b.min()) for b in batches)
    high = max(float(b.max()) for b in batches)
    assert first.qparams == quantize.activation_qparams(low, high, quantize.activation_qmax())


def test_a_1x1_convolution_runs_as_an_int8_gemm_on_codes(monkeypatch):
    """The GEMM form of a 1x1 convolution (chosen here whatever is faster on this machine)
    reads the codes the convolution before it writes, and matches the float64 simulation."""
    chosen = []

    def prefer_gemm(key, candidates, inputs, rounds=7, work=0.0):
        chosen.append(next(c for c in ("onednn-int8-gemm", "onednn-int8", "onednn",
                                       "reference") if c in candidates))
        return chosen[-1], 1e-3
    monkeypatch.setattr(choice, "choose", prefer_gemm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 24, 1),
                          nn.ReLU()).eval()
    x = torch.randn(1, 8, 10, 10)
    options = Options(measure=True, deterministic=True, precision="int8", native="off",
                      tuning_db=None)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=options)
        got = compiled(x)
        first, second = [s for s in _steps(compiled) if s.precision == "int8"]
        h = F.relu(F.conv2d(_fake_quant(x, first.fn.qparams), _fake_quant_weight(model[0].weight),
                            model[0].bias.double(), padding=1))
        want = F.relu(F.conv2d(_fake_quant(h, second.fn.qparams),
                               _fake_quant_weight(model[2].weight), model[2].bias.double()))
    assert "onednn-int8-gemm" in chosen  # offered for the 1x1 convolution, and so taken
    assert second.name == "conv+relu [int8]"
    assert first.fn.requantize == second.fn.qparams  # the GEMM reads codes
    assert isinstance(second.fn, int8.Int8Group) and second.fn.in_int8
    assert _rel_l2(got, want) < 1e-5
