"""opweave.profile: every level adds up to the measured call, costs land on the user's
source lines and modules, fused steps split by FLOPs, and the runtime is left as it was."""
from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import opweave
from opweave.cli import main
from opweave.ir import Graph, TensorType
from opweave.profiling import attribute
from opweave.profiling.record import Site

from ..conftest import compiled_small, small_model

THIS_FILE = __file__.rsplit("/", 1)[-1]


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 32)

    def forward(self, x):
        hidden = torch.relu(self.fc1(x))
        return self.fc2(hidden).softmax(-1)


class ConvNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.BatchNorm2d(16)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


class WithEagerPart(nn.Module):
    """`torch.cumprod` has no IR lowering: it runs in eager between two segments."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return torch.cumprod(y, 1).sum(-1) + y.abs().sum(-1)


def _compile(model, *inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return opweave.compile(model.eval(), inputs)


def _sums(prof) -> dict[str, float]:
    return {name: math.fsum(r.seconds for r in rows) for name, rows in prof.levels.all().items()}


def test_every_level_adds_up_to_the_measured_total_on_bert():
    bench = small_model("bert-base")
    prof = opweave.profile(compiled_small("bert-base"), bench.inputs, runs=3, warmup=1)
    rec = prof.recording
    kept = [rec.call_ns[i] for i in rec.kept]
    assert prof.levels.total == pytest.approx(sum(kept) / len(kept) / 1e9)
    for name, total in _sums(prof).items():
        assert total == pytest.approx(prof.levels.total, rel=1e-9), name
    timed = [s for s in rec.sites if s.ns]
    assert {"runtime", "cpp"} <= {s.kind for s in timed}  # generated kernels were timed
    assert any(n.op == "matmul" for s in timed for n in s.nodes)  # and the GEMMs (any form)
    assert any(r.key.startswith("encoder.layer.0") for r in prof.levels.modules)


def test_costs_land_on_the_models_source_lines_and_modules():
    compiled = _compile(TwoLayers(), torch.randn(16, 64))
    prof = opweave.profile(compiled, [torch.randn(16, 64)], runs=3, warmup=1)
    lines = {r.key for r in prof.levels.lines}
    # the line in this file's forward, not nn.Linear's own forward inside torch
    assert any(key.startswith(f"profiling/{THIS_FILE}:") for key in lines), lines
    assert not any("torch/nn/modules" in key for key in lines)
    modules = {r.key for r in prof.levels.modules}
    assert {"fc1", "fc2"} <= modules, modules
    fc1 = next(r for r in prof.levels.modules if r.key == "fc1")
    assert fc1.seconds > 0


def test_a_folded_batch_norm_leaves_the_convs_flops_on_the_conv():
    compiled = _compile(ConvNorm(), torch.randn(1, 3, 16, 16))
    prof = opweave.profile(compiled, [torch.randn(1, 3, 16, 16)], runs=2, warmup=1)
    conv_sites = [s for s in prof.recording.sites if any(n.op == "conv" for n in s.nodes)]
    assert conv_sites
    for site in conv_sites:
        conv = next(n for n in site.nodes if n.op == "conv")
        assert "[module conv]" in conv.source, conv.source


def test_eager_steps_are_sites_of_their_own():
    compiled = _compile(WithEagerPart(), torch.randn(2, 8))
    assert compiled.coverage.fallback, "the test needs an op that runs in eager"
    prof = opweave.profile(compiled, [torch.randn(2, 8)], runs=2, warmup=1)
    eager = [s for s in prof.recording.sites if s.kind == "eager" and s.ns]
    assert eager and any("cumprod" in s.name for s in eager)
    for total in _sums(prof).values():
        assert total == pytest.approx(prof.levels.total, rel=1e-9)


def test_a_fused_step_splits_its_time_by_flops():
    g = Graph("g")
    a = g.add_input("a", TensorType((64, 64), torch.float32))
    b = g.add_input("b", TensorType((64, 64), torch.float32))
    product = g.add1("matmul", [a, b])
    g.outputs = [g.add1("relu", [product])]
    site = Site(1, "library", "matmul+relu", "g", list(g.nodes))
    split = dict((n.op, share) for n, share in attribute.shares(site))
    matmul_flops, relu_flops = (attribute.node_cost(n)[0] for n in g.nodes)
    assert split["matmul"] == pytest.approx(matmul_flops / (matmul_flops + relu_flops))
    assert split["matmul"] + split["relu"] == pytest.approx(1.0)


def test_without_arithmetic_a_step_splits_by_bytes_and_else_evenly():
    g = Graph("g")
    x = g.add_input("x", TensorType((8, 16), torch.float32))
    index = g.add_input("index", TensorType((4,), torch.int64))
    picked = g.add1("index_select", [x, index], {"dim": 0})   # moves 4 rows
    joined = g.add1("cat", [x, x], {"dim": 0})                # moves 32 rows
    movers = [picked.producer, joined.producer]
    costs = [attribute.node_cost(n) for n in movers]
    assert all(flops == 0 for flops, _ in costs) and all(nbytes > 0 for _, nbytes in costs)
    split = [share for _, share in attribute.shares(Site(1, "op", "x", "g", movers))]
    total = sum(nbytes for _, nbytes in costs)
    assert split == pytest.approx([nbytes / total for _, nbytes in costs])
    assert split[1] > split[0]
    views = [g.add1("reshape", [x], {"shape": [128]}).producer,
             g.add1("reshape", [x], {"shape": [16, 8]}).producer]
    assert all(attribute.node_cost(n) == (0.0, 0.0) for n in views)
    split = [share for _, share in attribute.shares(Site(2, "op", "v", "g", views))]
    assert split == pytest.approx([0.5, 0.5])


def test_profiling_leaves_the_runtime_as_it_was():
    bench = small_model("xmlcnn")
    compiled = compiled_small("xmlcnn")
    for _ in range(4):  # past recording and checking: the native plan runs the calls
        compiled(*bench.inputs)
    program = compiled.program
    executors = [g.executor for g in program.compiled_graphs]
    calls_before = program._calls
    steps_before = [e._steps for e in executors]
    native_before = [(e.native.plan, e.native.reason) for e in executors]
    expected = compiled(*bench.inputs)
    opweave.profile(compiled, bench.inputs, runs=2, warmup=1)
    assert program._calls is calls_before
    assert [e._steps for e in executors] == steps_before
    assert [(e.native.plan, e.native.reason) for e in executors] == native_before
    assert any(plan is not None for plan, _ in native_before)
    torch.testing.assert_close(compiled(*bench.inputs), expected)


def test_an_onnx_model_is_profiled_too(tmp_path):
    g = Graph("tiny")
    x = g.add_input("x", TensorType((32, 64), torch.float32))
    w = g.add_constant("w", torch.randn(64, 64))
    g.outputs = [g.add1("relu", [g.add1("matmul", [x, w])])]
    path = tmp_path / "tiny.onnx"
    opweave.to_onnx(g, path)
    model = opweave.from_onnx(path)
    prof = opweave.profile(model, [torch.randn(32, 64)], runs=2, warmup=1)
    assert any(r.key.startswith("onnx:") and r.seconds > 0 for r in prof.levels.frontend)
    for total in _sums(prof).values():
        assert total == pytest.approx(prof.levels.total, rel=1e-9)


def test_the_trace_has_a_slice_per_timed_step_and_call(tmp_path):
    compiled = _compile(TwoLayers(), torch.randn(16, 64))
    prof = opweave.profile(compiled, [torch.randn(16, 64)], runs=2, warmup=1)
    data = json.loads(prof.write_trace(tmp_path / "trace.json").read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    calls = [e for e in slices if e["cat"] == "call"]
    assert len(calls) == 2
    steps = [e for e in slices if e["cat"] != "call"]
    assert len(steps) == len(prof.recording.events)
    for call in calls:  # the call's steps tile it
        inside = [e for e in steps if call["ts"] <= e["ts"] and e["ts"] + e["dur"] <= call["ts"] + call["dur"] + 1e-3]
        assert sum(e["dur"] for e in inside) == pytest.approx(call["dur"], rel=1e-6, abs=1e-3)
    assert all(e["pid"] == 1 and e["tid"] == 1 for e in slices)


def test_the_html_report_is_self_contained(tmp_path):
    bench = small_model("resnet50")
    prof = opweave.profile(compiled_small("resnet50"), bench.inputs, runs=2, warmup=1)
    text = prof.write_html(tmp_path / "report.html").read_text()
    for anchor in ('id="steps"', 'id="lines"', 'id="modules"', 'id="roofline"',
                   'class="graph"', "Before rewriting", "fusion groups coloured",
                   "why it runs alone", "Schedule"):
        assert anchor in text, anchor
    assert "<script src" not in text and "<link" not in text
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in text


def test_the_cli_prints_the_tables_and_writes_both_files(tmp_path, capsys):
    html_path, trace_path = tmp_path / "r.html", tmp_path / "t.json"
    assert main(["profile", "xmlcnn", "--small", "--runs", "2", "--warmup", "1", "--top", "5",
                 "--html", str(html_path), "--trace", str(trace_path)]) == 0
    out = capsys.readouterr().out
    assert "each level adds up to the measured total" in out
    assert "top 5 source lines" in out and "top 5 modules" in out
    assert html_path.stat().st_size > 0 and json.loads(trace_path.read_text())["traceEvents"]


def test_the_cli_refuses_what_is_neither_a_model_nor_a_file(capsys):
    assert main(["profile", "no-such-model"]) == 2
    assert "neither a benchmark model nor a file" in capsys.readouterr().err


def test_profile_refuses_a_plain_module():
    with pytest.raises(TypeError, match="opweave.compile, opweave.from_onnx or torch.compile"):
        opweave.profile(TwoLayers(), [torch.randn(2, 64)])


def test_the_cli_profiles_an_onnx_file(tmp_path, capsys):
    g = Graph("tiny")
    x = g.add_input("x", TensorType((8, 16), torch.float32))
    g.outputs = [g.add1("tanh", [g.add1("matmul", [x, g.add_constant("w", torch.randn(16, 16))])])]
    path = tmp_path / "tiny.onnx"
    opweave.to_onnx(g, path)
    assert main(["profile", str(path), "--runs", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "opweave profile of" in out and "each level adds up" in out


def test_a_torch_compile_module_is_profiled_with_dynamos_cost_apart():
    model = TwoLayers().eval()
    x = torch.randn(16, 64)
    compiled = torch.compile(model, backend="opweave")
    with torch.no_grad():
        prof = opweave.profile(compiled, [x], runs=2, warmup=1)
    outside = prof.recording.sites[0]
    assert outside.name.startswith("torch.compile") and outside.ns > 0
    assert any(s.kind != "runtime" and s.ns for s in prof.recording.sites)
    assert {"fc1", "fc2"} <= {r.key for r in prof.levels.modules}
    for total in _sums(prof).values():
        assert total == pytest.approx(prof.levels.total, rel=1e-9)


def test_a_graph_compiled_without_fusion_is_profiled_op_by_op():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = opweave.compile(TwoLayers().eval(), (torch.randn(4, 64),), fusion="off")
    prof = opweave.profile(compiled, [torch.randn(4, 64)], runs=2, warmup=1)
    ops = [s for s in prof.recording.sites if s.kind == "op" and s.ns]
    assert ops and all(len(s.nodes) == 1 for s in ops)
    assert {"fc1", "fc2"} <= {r.key for r in prof.levels.modules}
    for total in _sums(prof).values():
        assert total == pytest.approx(prof.levels.total, rel=1e-9)


class TwoLayersLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = TwoLayers()

    def forward(self, x, target):
        return nn.functional.mse_loss(self.model(x), target)


def test_a_training_step_is_profiled_forward_and_backward():
    x, target = torch.randn(16, 64), torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = opweave.compile(TwoLayersLoss(), (x, target), train=True)
    prof = opweave.profile(step, [x, target], runs=2, warmup=1)
    nodes = [n for s in prof.recording.sites if s.ns for n in s.nodes]
    # the backward ran and was timed: relu's gradient (le + where) and the weight and
    # input gradients' GEMMs beside the two forward ones
    assert {"le", "where"} <= {n.op for n in nodes}
    assert sum(n.op == "matmul" for n in nodes) >= 4
    # AOTAutograd's joint graph records neither the model's lines nor its modules: no
    # level may name torch's tracing code in their place
    assert not any("torch" in r.key or "proxy_tensor" in r.key for r in prof.levels.lines)
    for total in _sums(prof).values():
        assert total == pytest.approx(prof.levels.total, rel=1e-9)
