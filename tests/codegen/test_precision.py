"""precision="bf16": products, convolutions and attention on bfloat16 operands with float32
accumulation, everything else float32 (codegen/precision.py). Each test checks the
result against a float64 reference within bf16's tolerance and that the error is bf16's,
not float32's: a mode that silently stayed float32 fails."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave.codegen import anchor_group, library, precision
from opweave.options import Options
from opweave.runtime import native

pytestmark = pytest.mark.skipif(not anchor_group.supports(), reason="needs torch built with oneDNN")
# torch's oneDNN computes bf16 on CPUs with AVX-512 BW, AVX-NE-CONVERT or AMX; elsewhere
# "bf16" computes in float32 (test_without_bf16_it_computes_in_float32_and_says_so)
needs_bf16 = pytest.mark.skipif(not precision.bf16_supported(),
                                reason="torch's oneDNN has no bf16 on this CPU")

# relative L2 error of a bf16 computation: bf16 keeps 8 significant bits (2^-9 = 2e-3 per
# rounding); a float32 computation of these sizes stays below 1e-6
BF16_REL_L2 = 2e-2
FP32_REL_L2 = 1e-5


def _rel_l2(got: torch.Tensor, reference: torch.Tensor) -> float:
    return float((got.double() - reference).norm() / reference.norm())


def _options(mode: str) -> Options:
    # measure=False always takes the library form, so the test does not depend on which
    # form is faster on this machine
    return Options(measure=False, deterministic=True, precision=mode, native="off")


def _compile_and_check(model: nn.Module, inputs: tuple, bf16_steps: int):
    """Compile `model` in both precisions; return the bf16 step names."""
    model = model.eval()
    with torch.no_grad():
        reference = model.double()(*[x.double() for x in inputs])
        model.float()
        errors, names = {}, {}
        for mode in ("fp32", "bf16"):
            compiled = opweave.compile(model, inputs, options=_options(mode))
            got = compiled(*inputs)
            assert got.dtype == torch.float32
            errors[mode] = _rel_l2(got, reference)
            names[mode] = [s.name for g in compiled.program.compiled_graphs
                           for s in g.executor.lowered_steps]
    assert errors["fp32"] < FP32_REL_L2
    assert 10 * FP32_REL_L2 < errors["bf16"] < BF16_REL_L2, errors
    assert not any("[bf16]" in n for n in names["fp32"])
    assert sum("[bf16]" in n for n in names["bf16"]) == bf16_steps, names["bf16"]
    return names["bf16"]


@needs_bf16
def test_linear_layers_and_their_epilogues_run_in_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    names = _compile_and_check(model, (torch.randn(32, 64),), bf16_steps=2)
    assert "matmul+add+gelu [bf16]" in names


class _ResidualStack(nn.Module):
    """A transformer's residual stream in small: each layer adds a small update to it."""

    def __init__(self, width=64, layers=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                  nn.Linear(2 * width, width))
                                    for _ in range(layers))
        for layer in self.layers:
            layer[2].weight.data.mul_(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@needs_bf16
def test_a_products_residual_add_sums_in_float32(monkeypatch):
    """The residual stream is not rounded at each layer: the add is not the product's
    post-op in bf16 (it is in float32), and its error is well below the fused add's."""
    import importlib

    lowering = importlib.import_module("opweave.codegen.lower")
    torch.manual_seed(0)
    model = _ResidualStack().eval()
    x = torch.randn(32, 64) * 4
    with torch.no_grad():
        bf16 = opweave.compile(model, (x,), options=_options("bf16"))
        names = [s.name for g in bf16.program.compiled_graphs for s in g.executor.lowered_steps]
        assert sum("[bf16]" in n for n in names) == 12, names
        assert not any(n.startswith("matmul") and n.count("add") > 1 for n in names), names
        fp32 = opweave.compile(model, (x,), options=_options("fp32"))
        assert any(s.name.startswith("matmul+add+add") for g in fp32.program.compiled_graphs
                   for s in g.executor.lowered_steps)
        reference = model.double()(x.double())
        model.float()
        errors = {}
        for fused in (False, True):
            real = lowering.partition
            monkeypatch.setattr(lowering, "partition",
                                lambda *a, **k: real(*a, **{**k, "float32_residuals": not fused}))
            errors[fused] = _rel_l2(opweave.compile(model, (x,), options=_options("bf16"))(x),
                                    reference)
            monkeypatch.setattr(lowering, "partition", real)
    assert errors[False] < 0.5 * errors[True], errors


class _ResidualConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.conv = nn.Conv2d(16, 16, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.bn(self.stem(x)))
        return F.relu(self.conv(y) + y)


@needs_bf16
def test_convolutions_with_residual_run_in_bf16():
    torch.manual_seed(0)
    model = _ResidualConv()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    names = _compile_and_check(model, (torch.randn(2, 3, 16, 16),), bf16_steps=2)
    # the residual is the convolution's own operand: it cannot add into it in place
    assert not any("into its residual" in n for n in names)


class _Bottleneck(nn.Module):
    """ResNet's block: the residual is read by the first convolution, then only by the
    add after the second, so the second may add into it in place."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.conv1 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        return F.relu(self.conv2(F.relu(self.conv1(y))) + y)


@needs_bf16
@pytest.mark.parametrize("form", ["onednn-bf16", "onednn-direct-bf16"])
def test_a_bf16_convolution_adds_into_its_dead_residual_on_the_native_plan(monkeypatch, form):
    """torch's form and oneDNN's own: the residual the stem hands on in bf16 is summed
    into in place, call after call, the later calls replayed natively, with the
    reference's result (a stale or doubly added residual would be far off it)."""
    from opweave.codegen import choice, onednn_direct
    if form == "onednn-direct-bf16" and onednn_direct.bf16_problem() is not None:
        pytest.skip(onednn_direct.bf16_problem())
    monkeypatch.setattr(choice, "measure", lambda candidates, args, rounds=7: {
        name: [0.5 if name == form else 3.0] for name in candidates})
    monkeypatch.setattr(choice, "_CHOICES", {})
    monkeypatch.setattr(library, "amx_products_on_torch", lambda: False)
    monkeypatch.setattr(library, "amx_convolutions_direct", lambda: False)
    torch.manual_seed(0)
    model, x = _Bottleneck().eval(), torch.randn(2, 3, 16, 16)
    options = Options(deterministic=True, precision="bf16", native="wait", tuning_db=None)
    with torch.no_grad():
        reference = model.double()(x.double())
        model.float()
        compiled = opweave.compile(model, (x,), options=options)
        results = [compiled(x) for _ in range(4)]
    executor = compiled.program.compiled_graphs[0].executor
    into = [s for s in executor.lowered_steps if "(into its residual)" in s.name]
    assert len(into) == 1 and into[0].precision == "bf16" and into[0].overwrites is not None
    # called on a bf16 operand and residual, the step leaves its result in the residual
    operand, residual = (torch.randn(v.type.shape).to(torch.bfloat16)
                         .contiguous(memory_format=torch.channels_last)
                         for v in into[0].inputs[:2])
    with torch.no_grad():
        (out,) = into[0].fn(operand, residual)
    assert torch.equal(residual, out.to(torch.bfloat16))
    if native.unavailable() is None:
        assert executor.native.plan is not None, executor.native.describe()
    for got in results:
        assert 10 * FP32_REL_L2 < _rel_l2(got, reference) < BF16_REL_L2
        torch.testing.assert_close(got, results[0], rtol=0, atol=0)


class _UpConv(nn.Module):
    """U-Net's up path: a transposed convolution, then a convolution over it and a skip."""

    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.conv = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x, skip):
        return F.relu(self.conv(torch.cat([skip, self.up(x)], dim=1)))


@needs_bf16
def test_transposed_convolutions_run_in_bf16():
    torch.manual_seed(0)
    names = _compile_and_check(_UpConv(), (torch.randn(1, 16, 8, 8), torch.randn(1, 8, 16, 16)),
                               bf16_steps=2)
    assert "conv_transpose [bf16]" in names


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 10, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 10, 32)


@needs_bf16
def test_attention_runs_in_bf16():
    torch.manual_seed(0)
    names = _compile_and_check(_Attention(), (torch.randn(2, 10, 32),), bf16_steps=2)
    assert "attention [bf16]" in names


def _error_of(compile_fn, model: nn.Module, x: torch.Tensor):
    """(relative L2 error against float64, the compiled model) of `compile_fn(model)`."""
    model = model.eval()
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
        compiled = compile_fn(model)
        return _rel_l2(compiled(x), ref), compiled


@needs_bf16
def test_fusion_off_applies_the_policy_to_single_ops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(8, 16)
    err, compiled = _error_of(lambda m: opweave.compile(m, (x,), fusion="off",
                                                        options=_options("bf16")), model, x)
    assert 10 * FP32_REL_L2 < err < BF16_REL_L2
    names = [s.name for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps]
    assert names.count("matmul [bf16]") == 2


@needs_bf16
def test_dynamo_backend_takes_the_precision_option(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")  # the library form, whichever is faster here
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 16))
    err, _ = _error_of(lambda m: torch.compile(m, backend="opweave",
                                               options={"precision": "bf16"}),
                       model, torch.randn(8, 64))
    assert 10 * FP32_REL_L2 < err < BF16_REL_L2


@needs_bf16
def test_onnx_takes_the_precision_option():
    from ..onnx.helpers import mlp, mlp_reference

    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    got = opweave.from_onnx(mlp().SerializeToString(), options=_options("bf16"))(x)
    got = got[0] if isinstance(got, (list, tuple)) else got
    ref = mlp_reference(x.astype(np.float64))
    err = float(np.linalg.norm(np.asarray(got, np.float64) - ref) / np.linalg.norm(ref))
    assert 10 * FP32_REL_L2 < err < BF16_REL_L2


def test_training_computes_in_float32():
    model = nn.Sequential(nn.Linear(8, 4))
    loss = lambda x: model(x).square().mean()  # noqa: E731
    with pytest.raises(ValueError, match="training step computes in float32"):
        opweave.compile(_Loss(model), (torch.randn(4, 8),), train=True, precision="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = opweave.compile(_Loss(model), (torch.randn(4, 8),), train=True,
                               options=_options("bf16"))
    assert any("training graphs compute in float32" in str(w.message) for w in caught)
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(step(x.float()), loss(x.float()), rtol=1e-6, atol=1e-6)


class _Loss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).square().mean()


def test_an_unknown_precision_is_refused():
    message = "precision must be one of fp32, bf16, bf16x3, int8, int8-dynamic; got 'fp16'"
    with pytest.raises(ValueError, match=message):
        Options(precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        opweave.compile(nn.Linear(2, 2), (torch.randn(1, 2),), precision="fp16")


@needs_bf16
def test_bf16_choices_are_recorded_apart_from_float32_ones():
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("lin")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    y = linear(g, x, 8, 16, "fc")
    g.outputs = [y]
    anchor = next(n for n in g.nodes if n.op == "matmul")
    ep = Epilogue()
    assert library.signature(g, anchor, ep) != library.signature(g, anchor, ep, "bf16")
    assert library.signature(g, anchor, ep, "fp32") == library.signature(g, anchor, ep)


@needs_bf16
def test_a_group_stays_float32_where_a_float32_form_measures_clearly_faster(monkeypatch):
    """The measured choice sees a group's float32 forms beside its bf16 ones. With the
    timings stubbed (no test depends on this machine's speed): the second linear layer's
    float32 forms take half its bf16 forms' time, so it computes in float32; the first
    one's float32 forms are slower, so it computes in bf16 and widens its result for the
    second. Each form's samples are recorded."""
    from opweave.codegen import choice

    seen = {}

    def stub_measure(candidates, args, rounds=7):
        second = args[0].shape[-1] == 256
        seen[second] = set(candidates)
        return {name: [1.0 if name.endswith("-bf16") else 0.5 if second else 2.0]
                for name in candidates}

    monkeypatch.setattr(choice, "measure", stub_measure)
    monkeypatch.setattr(choice, "_CHOICES", {})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 32)).eval()
    x = torch.randn(16, 64)
    options = Options(deterministic=True, precision="bf16", native="off", tuning_db=None)
    with torch.no_grad():
        reference = model.double()(x.double())
        model.float()
        compiled = opweave.compile(model, (x,), options=options)
        got = compiled(x)
    assert {"reference", "onednn", "onednn-bf16"} <= seen[True] == seen[False]
    steps = [s for s in compiled.program.compiled_graphs[0].executor.lowered_steps
             if s.kind == "library"]
    assert [s.precision for s in steps] == ["bf16", "fp32"], [s.name for s in steps]
    assert "[bf16]" not in steps[1].name
    assert precision.low_precision_call(steps[0]).keep_low == frozenset()  # widened
    assert precision.low_precision_call(steps[1]) is None
    assert 10 * FP32_REL_L2 < _rel_l2(got, reference) < BF16_REL_L2


class _TwoBlocks(nn.Module):
    """A stem and two residual blocks: each block's second convolution adds its input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(16, 16, 3, padding=1) for _ in range(4))

    def forward(self, x):
        h = F.relu(self.stem(x))
        for first, second in zip(self.convs[::2], self.convs[1::2]):
            h = F.relu(second(F.relu(first(h))) + h)
        return h.mean((2, 3))


@pytest.mark.parametrize("residual_handed", [False, True])
def test_a_form_handed_bf16_is_measured_on_the_operand_it_would_read(residual_handed):
    """Where a group's operand comes to it in bf16, its bf16 forms are measured on that
    operand as it is, its float32 forms on it widened: each reads what it would read
    between bf16 steps, not a float32 operand the bf16 forms would round at every call.
    Its residual is read so too where it may come in bf16, else as float32."""
    from opweave.codegen import choice

    read = {}

    def form(name):
        def fn(x, residual):
            read[name] = (x.clone(), residual.clone())
            return [x]
        return fn

    names = ("onednn-direct-bf16", "onednn-bf16", "onednn-direct", "reference")
    x, residual = torch.randn(4, 8), torch.randn(4, 8)
    handed = choice.handed_bf16({n: form(n) for n in names}, residual=residual_handed)
    samples = choice.measure(handed, [x, residual], rounds=1)
    assert set(samples) == set(names) and all(len(t) == 1 for t in samples.values())
    for name in names:
        low = torch.bfloat16 if name.endswith("-bf16") else torch.float32
        seen, seen_residual = read[name]
        assert seen.dtype == low, name
        assert torch.equal(seen.float(), x.to(torch.bfloat16).float()), name  # rounded once
        if residual_handed:
            assert seen_residual.dtype == low, name
            assert torch.equal(seen_residual.float(), residual.to(torch.bfloat16).float())
        else:
            assert seen_residual.dtype == torch.float32 and torch.equal(seen_residual, residual)


@needs_bf16
def test_only_a_group_handed_bf16_measures_its_forms_on_a_bf16_operand(monkeypatch):
    """A convolution reading another's result (handed bf16) measures its forms on a bf16
    operand; the first one, reading the graph's float32 input, on that input as it is."""
    from opweave.codegen import choice

    operands = {}

    def stub_measure(candidates, args, rounds=7):
        own = {name: fn.measured_args(args) if hasattr(fn, "measured_args") else args
               for name, fn in candidates.items()}
        operands[args[0].shape[1]] = {a[0].dtype for a in own.values()}
        return {name: [1.0 if name.endswith("-bf16") else 2.0] for name in candidates}

    monkeypatch.setattr(choice, "measure", stub_measure)
    monkeypatch.setattr(choice, "_CHOICES", {})
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1, groups=16)).eval()
    x = torch.randn(1, 8, 12, 12)
    options = Options(deterministic=True, precision="bf16", native="off", tuning_db=None)
    with torch.no_grad():
        opweave.compile(model, (x,), options=options)
    assert operands == {8: {torch.float32}, 16: {torch.bfloat16}}


class _InputResidual(nn.Module):
    """Two residual adds: one onto a convolution's result (it may come in bf16), one onto
    the graph's float32 input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(8, 8, 1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        return self.conv2(F.relu(self.conv1(y) + y)) + x


@needs_bf16
def test_a_residual_that_may_come_in_bf16_is_measured_in_bf16(monkeypatch):
    """The bf16 forms of a group whose residual is a convolution's result are measured on
    a bf16 residual; one whose residual is the graph's input, on the float32 input."""
    from opweave.codegen import choice

    residuals = []

    def stub_measure(candidates, args, rounds=7):
        if len(args) >= 2:
            low = next(fn for name, fn in candidates.items() if name.endswith("-bf16"))
            own = low.measured_args(args)
            residuals.append(own[1].dtype)
        return {name: [1.0 if name.endswith("-bf16") else 2.0] for name in candidates}

    monkeypatch.setattr(choice, "measure", stub_measure)
    monkeypatch.setattr(choice, "_CHOICES", {})
    options = Options(deterministic=True, precision="bf16", native="off", tuning_db=None)
    with torch.no_grad():
        opweave.compile(_InputResidual().eval(), (torch.randn(1, 8, 6, 6),), options=options)
    # (the partitioner measures conv1's group with and without its ReLU)
    assert set(residuals) == {torch.bfloat16, torch.float32}, residuals


class _SiluBlocks(nn.Module):
    """Convolutions with SiLU between them (a pointwise kernel over one tensor), a
    layer norm whose result a SiLU kernel reads, and a SiLU whose result is the output."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(8, 32, 1)
        self.depthwise = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.project = nn.Conv2d(32, 16, 1)
        self.norm = nn.LayerNorm(10)

    def forward(self, x):
        y = self.depthwise(F.silu(self.expand(x)))
        y = self.project(F.silu(y))
        return F.silu(self.project(F.silu(self.norm(x.repeat(1, 4, 1, 1))))) + F.silu(y)


@needs_bf16
def test_a_fused_kernel_reads_bf16_results_as_they_come_and_writes_bf16_for_bf16_readers(
        monkeypatch):
    """A SiLU kernel between two bf16 convolutions is handed the first one's result in
    bf16 and hands its own on in bf16; the last kernel reads both convolutions' results in
    bf16 and writes the graph's output in float32; the kernel after the layer norm reads
    float32 (a norm's result is not rounded for it). The values are those of the float32
    kernels between widened copies, to the bit, and of the float32 kernels converting
    around them where their bf16 forms are not built (timings stubbed: every group in
    bf16)."""
    import importlib

    from opweave.codegen import choice

    lowering = importlib.import_module("opweave.codegen.lower")  # the package names a function so

    def stub_measure(candidates, args, rounds=7):
        return {name: [1.0 if name == "onednn-direct-bf16" else 2.0] for name in candidates}

    monkeypatch.setattr(choice, "measure", stub_measure)
    torch.manual_seed(0)
    model, x = _SiluBlocks().eval(), torch.randn(1, 8, 10, 10)
    options = Options(deterministic=True, precision="bf16", tuning_db=None)
    compiled = {}
    with torch.no_grad():
        for way in ("forms", "converting", "widened"):
            monkeypatch.setattr(choice, "_CHOICES", {})
            if way == "converting":
                monkeypatch.setattr(lowering, "_build_bf16_forms", lambda lowered, graph: None)
            if way == "widened":
                monkeypatch.setattr(precision, "has_bf16_forms", lambda step: False)
            compiled[way] = opweave.compile(model, (x,), options=options)
        got = compiled["forms"](x)
        for way in ("converting", "widened"):
            assert torch.equal(got, compiled[way](x)), way
        reference = model.double()(x.double())
    assert _rel_l2(got, reference) < BF16_REL_L2
    steps = compiled["forms"].program.compiled_graphs[0].executor.lowered_steps
    kernels = [s.fn.source for s in steps if s.kind == "cpp"]
    both = [k for k in kernels if k.low_inputs and k.low_outputs]
    assert len(both) == 2, [(k.low_inputs, k.low_outputs) for k in kernels]  # between convs
    last = [k for k in kernels if k.low_inputs and not k.low_outputs]
    assert len(last) == 1 and len(last[0].low_inputs) == 2  # reads both, writes the output
    assert any(not k.low_inputs for k in kernels)  # the one after the norm
    widened = compiled["widened"].program.compiled_graphs[0].executor.lowered_steps
    assert not any(s.fn.source.low_inputs or s.fn.source.low_outputs
                   for s in widened if s.kind == "cpp")


class _PostNorm(nn.Module):
    """BERT's post-norm layer, twice: each norm's result is the next layer's residual (read
    in float32) and the next products' operand (read in bf16)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(2))

    def forward(self, x):
        for k, norm in enumerate(self.norms):
            x = norm(x + self.inner[2 * k + 1](F.gelu(self.inner[2 * k](x))))
        return x


@needs_bf16
def test_a_result_read_in_both_types_is_written_in_both(monkeypatch):
    """A residual add and norm whose result the next products read (in bf16) and the next
    residual add reads (in float32): the kernel also writes it rounded, into a value of
    its own that the products read through their view, so no step rounds it in a copy;
    the values are those of the copies, to the bit."""
    torch.manual_seed(0)
    model, x = _PostNorm().eval(), torch.randn(2, 24, 64)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
        got = compiled(x)
        monkeypatch.setattr(precision, "bf16_twins", lambda steps, outputs: {})
        copying = opweave.compile(model, (x,), options=_options("bf16"))
        assert torch.equal(got, copying(x))
        reference = model.double()(x.double())
    assert _rel_l2(got, reference) < BF16_REL_L2
    steps = compiled.program.compiled_graphs[0].executor.lowered_steps
    twinned = [s for s in steps if s.kind == "cpp" and s.fn.source.twins]
    assert len(twinned) == 1  # the first norm (the second's result is the output)
    kernel = twinned[0]
    (at,) = kernel.fn.source.twins
    source, twin = kernel.outputs[at], kernel.outputs[-1]
    assert twin.type.dtype == torch.bfloat16 and source.type.dtype == torch.float32
    through = {twin} | {v for s in steps if twin in s.inputs for v in s.outputs}  # its view
    assert any(s.precision == "bf16" and through & set(s.inputs) for s in steps)
    # the float32 result goes on only to float32 steps (the next residual add)
    readers = [s for s in steps if source in s.inputs]
    assert readers and all(s.precision != "bf16" for s in readers)


@needs_bf16
def test_a_float32_convolution_between_bf16_ones_adds_into_its_residual(monkeypatch):
    """With the timings stubbed, the convolutions adding a residual measure faster in
    float32 (oneDNN's form): they run in float32 and add into their residual in place, as
    float32 compiles do, their bf16 neighbours widening what they hand them."""
    from opweave.codegen import choice

    def stub_measure(candidates, args, rounds=7):
        residual = len(args) >= 2
        return {name: [1.0 if name.endswith("-bf16") else 0.5 if residual and name == "onednn"
                       else 3.0] for name in candidates}

    monkeypatch.setattr(choice, "measure", stub_measure)
    monkeypatch.setattr(choice, "_CHOICES", {})
    torch.manual_seed(0)
    model = _TwoBlocks().eval()
    x = torch.randn(1, 3, 12, 12)
    options = Options(deterministic=True, precision="bf16", native="off", tuning_db=None)
    with torch.no_grad():
        reference = model.double()(x.double())
        model.float()
        compiled = opweave.compile(model, (x,), options=options)
        results = [compiled(x) for _ in range(3)]
    steps = [s for s in compiled.program.compiled_graphs[0].executor.lowered_steps
             if s.kind == "library"]
    added = [s for s in steps if "add" in s.name]
    assert len(added) == 2 and all(s.precision == "fp32" for s in added), \
        [s.name for s in steps]
    assert sum(s.overwrites is not None for s in added) >= 1  # in place, as in float32
    assert all(s.precision == "bf16" for s in steps if s not in added)
    for got in results:
        assert 10 * FP32_REL_L2 < _rel_l2(got, reference) < BF16_REL_L2
        torch.testing.assert_close(got, results[0], rtol=0, atol=0)


def test_which_operands_may_arrive_in_bf16():
    """Structural: made by a product (or its epilogue) or a layer norm, through views,
    cat and poolings; not a graph input or output, nor the result of an op that computes
    in float32."""
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("arrivals")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    h = g.add1("relu", [linear(g, x, 8, 16, "fc1")])
    both = g.add1("cat", [g.add1("reshape", [h], {"shape": [4, 16]}), x], {"dim": 1})
    w = g.add_constant("ln_w", torch.ones(24))
    b = g.add_constant("ln_b", torch.zeros(24))
    normed = g.add("layer_norm", [both, w, b], {"normalized_shape": [24], "eps": 1e-5})[0]
    soft = g.add1("softmax", [h], {"dim": -1})  # computes in float32
    assert not precision.may_arrive_in_bf16(x)
    assert precision.may_arrive_in_bf16(h)
    assert precision.may_arrive_in_bf16(both)
    assert precision.may_arrive_in_bf16(normed)
    assert not precision.may_arrive_in_bf16(soft)
    # a norm rounds its own result for readers that round, whatever it reads
    alone = g.add("layer_norm", [x, g.add_constant("w8", torch.ones(8)),
                                 g.add_constant("b8", torch.zeros(8))],
                  {"normalized_shape": [8], "eps": 1e-5})[0]
    assert precision.may_arrive_in_bf16(alone)
    # poolings with bf16 kernels pass it on; a graph output stays float32
    rows = g.add1("reshape", [h], {"shape": [1, 4, 16]})
    pooled = g.add1("adaptive_max_pool2d", [rows], {"output_size": [2, 4]})
    assert precision.may_arrive_in_bf16(pooled)
    assert not precision.may_arrive_in_bf16(pooled, frozenset([pooled]))
    assert not precision.may_arrive_in_bf16(pooled, frozenset([h]))
    g.outputs = [linear(g, soft, 16, 4, "fc2"), linear(g, normed, 24, 4, "fc3")]
    anchors = [n for n in g.nodes if n.op == "matmul"]
    keys = [library.signature(g, a, Epilogue(), "bf16") for a in anchors]
    # the choice depends on it, so its record does too
    assert [("reads", "bf16") in k for k in keys] == [False, False, True]
    assert all(("precision", "bf16") in k for k in keys)


def test_which_results_may_leave_in_bf16():
    """Structural: every reader takes it in bf16, a product or convolution (which round
    it), a pointwise op or a layer norm (which widen it exactly), through views and
    poolings; not a graph output, nor a result a reduction reads. The record says so."""
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("leavings")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    to_kernel = linear(g, x, 8, 16, "fc1")
    to_product = g.add1("relu", [to_kernel])
    to_pooling = linear(g, to_product, 16, 16, "fc2")
    rows = g.add1("reshape", [to_pooling], {"shape": [1, 4, 16]})
    pooled = g.add1("adaptive_max_pool2d", [rows], {"output_size": [2, 4]})
    to_mean = linear(g, g.add1("reshape", [pooled], {"shape": [2, 4]}), 4, 16, "fc3")
    mean = g.add1("mean", [to_mean], {"dims": [1], "keepdim": False})
    to_output = linear(g, g.add1("reshape", [mean], {"shape": [1, 2]}), 2, 4, "fc4")
    g.outputs = [to_output]
    users = g.users()
    assert precision.may_leave_in_bf16(to_kernel, users)      # a ReLU kernel widens it
    assert precision.may_leave_in_bf16(to_product, users)     # fc2 rounds it
    assert precision.may_leave_in_bf16(to_pooling, users)     # through the pooling to fc3
    assert not precision.may_leave_in_bf16(to_mean, users)    # a reduction reads it
    assert not precision.may_leave_in_bf16(to_output, users)  # the graph's output
    # the group's result is its epilogue's: here each product's bias add
    anchors = [n for n in g.nodes if n.op == "matmul"]
    adds = [next(u for u in users[a.outputs[0]] if u.op == "add") for a in anchors]
    keys = [library.signature(g, a, Epilogue(bias=add, chain=(add,)), "bf16")
            for a, add in zip(anchors, adds)]
    assert [("leaves", "bf16") in k for k in keys] == [True, True, False, False]
    assert all(("precision", "bf16") in k for k in keys)


def test_a_form_whose_result_may_leave_in_bf16_is_measured_so():
    """Where a group's result may leave in bf16, its bf16 forms are measured with the
    result as they compute it, not widened, and its float32 forms with the result rounded,
    as their readers would round it."""
    from opweave.codegen import choice
    from opweave.codegen.lower import _Leading

    def doubled(x):
        return [x * 2]

    candidates = {"onednn-direct-bf16": _Leading(precision.LowPrecisionCall(doubled), 1),
                  "onednn-direct": _Leading(doubled, 1), "reference": doubled}
    x = torch.randn(4, 8)
    leaving = choice.leaving_bf16(candidates)
    for name, fn in leaving.items():
        (y,) = fn(x)
        assert y.dtype == torch.bfloat16, name
        exact = x.to(torch.bfloat16) * 2 if name.endswith("-bf16") else (x * 2).to(torch.bfloat16)
        assert torch.equal(y, exact), name
    # the step itself still widens until `hand_off_in_bf16` says otherwise
    assert candidates["onednn-direct-bf16"](x)[0].dtype == torch.float32
    assert set(choice.measure(leaving, [x], rounds=1)) == set(candidates)


def test_a_float32_kernel_between_bf16_steps_is_charged_its_conversions():
    """The partitioner's price of a float32 group under bf16: the widening of what it
    reads from bf16 steps and the rounding of what it hands them; none for a group with a
    product, for ops that take bf16 as it comes, or for a graph output, and for a fused
    kernel only the rounded copy it writes of a result float32 steps read too."""
    from opweave.codegen.render import FUSIBLE
    from opweave.ir import Graph, TensorType
    from opweave.partition.context import Context

    from ..partition.graphs import linear

    g = Graph("between")
    x = g.add_input("x", TensorType((16, 32), torch.float32))
    h = linear(g, x, 32, 32, "fc1")
    r = g.add1("add", [h, x])
    w, b = g.add_constant("ln_w", torch.ones(32)), g.add_constant("ln_b", torch.zeros(32))
    n = g.add("layer_norm", [r, w, b], {"normalized_shape": [32], "eps": 1e-5})[0]
    y = linear(g, n, 32, 8, "fc2")
    g.outputs = [g.add1("relu", [y])]
    ctx = Context(g, FUSIBLE)
    add, norm = r.producer, n.producer
    size = 16 * 32 * 4
    # a fused kernel reads fc1's result in bf16 and writes the norm's in bf16 for fc2
    assert precision.conversion_bytes(ctx, frozenset([add, norm])) == 0
    assert precision.conversion_bytes(ctx, frozenset([add])) == size * 3 // 2  # x: an input
    assert precision.conversion_bytes(ctx, frozenset([norm])) == 0  # a MixedCall
    # a float32 op reading a norm's result: the norm writes float32 for it, nothing widens
    soft = g.add1("softmax", [n], {"dim": -1})
    assert precision.conversion_bytes(Context(g, FUSIBLE), frozenset([soft.producer])) == 0
    # now read in float32 too, the kernel writes the norm's result in float32 and once
    # more rounded for fc2 (2 bytes an element)
    assert precision.conversion_bytes(Context(g, FUSIBLE), frozenset([add, norm])) \
        == size // 2
    assert precision.conversion_bytes(ctx, frozenset([h.producer.inputs[0].producer,
                                                      h.producer])) == 0  # a product
    relu = g.outputs[0].producer  # widens what it reads, writes a graph output
    assert precision.conversion_bytes(ctx, frozenset([relu])) == 16 * 8 * 4 * 3 // 2
    g.outputs.append(y)  # a graph output is widened for it anyway
    assert precision.conversion_bytes(Context(g, FUSIBLE), frozenset([relu])) == 0
    # a pointwise kernel over one tensor between bf16 steps reads and writes bf16
    silu = g.add1("mul", [h, g.add1("sigmoid", [h])])
    z = linear(g, silu, 32, 8, "fc3")
    g.outputs.append(z)
    ctx = Context(g, FUSIBLE)
    assert precision.conversion_bytes(ctx, frozenset([silu.producer,
                                                      silu.producer.inputs[1].producer])) == 0
    assert precision.conversion_bytes(ctx, frozenset([silu.producer])) > 0  # reads sigmoid's


def test_units_reads_the_cpus_flags():
    line = "processor\t: 0\nflags\t\t: fpu sse avx2 fma {}\nbugs\t\t: none\n"
    assert precision.units(line.format("")).startswith("no bf16 units")
    assert precision.units(line.format("avx512f avx512_bf16")).startswith("AVX-512 BF16")
    assert precision.units(line.format("avx512_bf16 amx_bf16 amx_tile")) == "AMX bf16 tiles"


@needs_bf16
def test_explain_says_how_many_steps_run_in_bf16(monkeypatch):
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")  # the library form, whichever is faster here
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    text = str(opweave.explain(model, (torch.randn(4, 32),), graph_breaks=False,
                               precision="bf16"))
    assert "precision: bf16: 2 of 2 product/convolution/attention steps in bf16" in text
    assert precision.units() in text
    assert "precision:" not in str(opweave.explain(model, (torch.randn(4, 32),),
                                                   graph_breaks=False))


@needs_bf16
def test_a_result_only_bf16_steps_read_is_handed_on_in_bf16():
    """Linear -> GELU (fused) -> Linear: the first group's result is read only by the second
    (a bf16 step), so it stays bf16 instead of being widened and rounded again; the
    graph's output is widened. The rounding is the same either way: the result equals the
    one computed with every result widened."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    x = torch.randn(32, 64)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
        got = compiled(x)
        steps = compiled.program.compiled_graphs[0].executor.lowered_steps
        calls = [precision.low_precision_call(s) for s in steps if s.precision == "bf16"]
        assert [c.keep_low for c in calls] == [frozenset({0}), frozenset()]
        widened = opweave.compile(model, (x,), options=_options("bf16"))
        for s in widened.program.compiled_graphs[0].executor.lowered_steps:
            call = precision.low_precision_call(s)
            if call is not None:
                call.keep_low = frozenset()
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, widened(x), rtol=0, atol=0)


def test_a_mixed_call_computes_in_float32_on_a_bf16_operand():
    """A layer norm handed a bf16 operand computes on it in float32 (torch's mixed-dtype
    kernel): rounded once where only bf16 steps read its result; where float32 is wanted,
    exactly the float32 norm of the widened operand."""
    torch.manual_seed(0)
    x = torch.randn(64, 96).to(torch.bfloat16)
    weight, bias = torch.randn(96), torch.randn(96)
    norm = lambda t, w, b: list(torch.ops.aten.native_layer_norm(t, [96], w, b, 1e-5))  # noqa: E731
    exact = norm(x.float(), weight, bias)
    call = precision.MixedCall(norm)
    wide = call(x, weight, bias)
    assert [y.dtype for y in wide] == [torch.float32] * 3
    for got, want in zip(wide, exact):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    call.keep_low = frozenset({0})
    low = call(x, weight, bias)
    assert low[0].dtype == torch.bfloat16 and low[1].dtype == torch.float32
    # the float32 result rounded once: at most a bf16 unit where float32's own rounding
    # of the norm differs between torch's kernels
    ulp = exact[0].abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((low[0].float() - exact[0]).abs() <= ulp).all()
    assert (low[0] != exact[0].to(torch.bfloat16)).float().mean() < 1e-3
    # a float32 operand (its producer hands on float32) is rounded after the norm
    torch.testing.assert_close(call(x.float(), weight, bias)[0], exact[0].to(torch.bfloat16),
                               rtol=0, atol=0)
    # off the CPU torch's mixed-dtype kernel is not counted on: the operand is widened
    seen = []
    spy = precision.MixedCall(lambda t, w, b: seen.append(t.dtype) or norm(t, w, b))
    spy.keep_low = frozenset({0})
    meta = [t.to("meta") for t in (x, weight, bias)]
    assert spy(*meta)[0].dtype == torch.bfloat16 and seen == [torch.float32]


@needs_bf16
def test_a_layer_norm_between_bf16_products_reads_and_writes_bf16():
    """Linear (no bias: the norm is a step of its own, not fused with the add) ->
    LayerNorm -> Linear: the norm is read only by a bf16 product and reads only one, so
    the first product hands it its result in bf16 and it hands its own on in bf16 (no
    widened copies). It still computes in float32: the output agrees with the path that
    widens every result within float32's noise on the rounding, far inside bf16's error;
    a norm whose result is the graph's output writes float32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.LayerNorm(128),
                          nn.Linear(128, 32)).eval()
    x = torch.randn(48, 64)
    with torch.no_grad():
        reference = model.double()(x.double())
        model.float()
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
        got = compiled(x)
        steps = compiled.program.compiled_graphs[0].executor.lowered_steps
        norms = [s for s in steps if isinstance(s.fn, precision.MixedCall)]
        assert len(norms) == 1 and norms[0].fn.keep_low == frozenset({0})
        first = precision.low_precision_call(next(s for s in steps if s.precision == "bf16"))
        assert first.keep_low == frozenset({0})
        widened = opweave.compile(model, (x,), options=_options("bf16"))
        for s in widened.program.compiled_graphs[0].executor.lowered_steps:
            call = s.fn if isinstance(s.fn, precision.MixedCall) else \
                precision.low_precision_call(s)
            if call is not None:
                call.keep_low = frozenset()
        assert got.dtype == torch.float32
        assert _rel_l2(got, widened(x).double()) < 1e-3
        assert _rel_l2(got, reference) < BF16_REL_L2

        last = nn.Sequential(nn.Linear(64, 128, bias=False), nn.LayerNorm(128)).eval()
        compiled = opweave.compile(last, (x,), options=_options("bf16"))
        norm = next(s for s in compiled.program.compiled_graphs[0].executor.lowered_steps
                    if isinstance(s.fn, precision.MixedCall))
        assert norm.fn.keep_low == frozenset()
        assert compiled(x).dtype == torch.float32
        assert _rel_l2(compiled(x), last.double()(x.double())) < BF16_REL_L2


@needs_bf16
def test_a_norm_read_only_by_another_norm_is_not_rounded():
    """A norm's float32 result goes to a second norm: nothing rounds it, so it stays
    float32, and two norms alone keep float32's accuracy under "bf16" (a norm reading
    the other's result in bf16 would add a rounding that was not there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.LayerNorm(128),
                          nn.LayerNorm(128)).eval()
    norms_only = nn.Sequential(nn.LayerNorm(128), nn.LayerNorm(128)).eval()
    x = torch.randn(48, 64)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
        steps = compiled.program.compiled_graphs[0].executor.lowered_steps
        norms = [s.fn for s in steps if isinstance(s.fn, precision.MixedCall)]
        assert [n.keep_low for n in norms] == [frozenset(), frozenset()]
        # the product's result, rounded already, still goes to the first norm in bf16
        first = precision.low_precision_call(next(s for s in steps if s.precision == "bf16"))
        assert first.keep_low == frozenset({0})
        h = torch.randn(48, 128) * 3 + 1
        got = opweave.compile(norms_only, (h,), options=_options("bf16"))(h)
        assert _rel_l2(got, norms_only.double()(h.double())) < FP32_REL_L2


class _PoolAndJoin(nn.Module):
    """A convolution, max pooling (a generated kernel), then two convolutions whose
    results are joined (cat) for a last one: ResNet's stem and XML-CNN's shape."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.left, self.right = nn.Conv2d(16, 8, 1), nn.Conv2d(16, 8, 3, padding=1)
        self.last = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        return self.last(torch.cat([F.relu(self.left(y)), F.relu(self.right(y))], 1))


@needs_bf16
def test_a_result_passes_through_max_pooling_and_cat_in_bf16():
    """Max pooling and concatenation only pick and move elements, so a bf16 result read
    through them by bf16 steps only is handed on in bf16 (the pooling runs its bf16
    kernel): the result is the one every widened result gives, to the bit."""
    torch.manual_seed(0)
    model = _PoolAndJoin().eval()
    x = torch.randn(1, 3, 20, 20)
    with torch.no_grad():
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
        got = compiled(x)
        steps = compiled.program.compiled_graphs[0].executor.lowered_steps
        handed = [s for s in steps if precision.low_precision_call(s) is not None
                  and precision.low_precision_call(s).keep_low]
        assert len(handed) == 3  # the stem and the two joined; the last is the output
        pool = next(s for s in steps if s.kind == "cpp")
        assert precision.passes_bf16(pool)
        widened = opweave.compile(model, (x,), options=_options("bf16"))
        for s in widened.program.compiled_graphs[0].executor.lowered_steps:
            call = precision.low_precision_call(s)
            if call is not None:
                call.keep_low = frozenset()
        torch.testing.assert_close(got, widened(x), rtol=0, atol=0)
        ran = []  # (step kind, its operands' dtypes) of one more call
        executor = compiled.program.compiled_graphs[0].executor
        with executor.instrumented(lambda i, fn: (lambda *a: ran.append(
                (steps[i].kind, [t.dtype for t in a])) or fn(*a))):
            compiled(x)
        assert ("cpp", [torch.bfloat16]) in ran  # the pooling's bf16 kernel
        assert ("op", [torch.bfloat16] * 2) in ran  # the cat


def test_without_bf16_it_computes_in_float32_and_says_so(monkeypatch):
    """Where torch's oneDNN has no bf16 (an AVX2-only CPU: it refuses to pack a bf16
    weight), the model computes in float32, with one warning, instead of failing."""
    from opweave import notices

    monkeypatch.setattr(precision, "bf16_supported", lambda: False)
    monkeypatch.setattr(notices, "_WARNED", set())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    with pytest.warns(notices.OpweaveFallbackWarning, match="'bf16' computes in float32 here"):
        compiled = opweave.compile(model, (x,), options=_options("bf16"))
    names = [s.name for g in compiled.program.compiled_graphs for s in g.executor.lowered_steps]
    assert not any("[bf16]" in n for n in names)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
