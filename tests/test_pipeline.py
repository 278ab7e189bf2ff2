"""The pipeline driver: one list of passes for every frontend, instruments that time,
verify and dump the IR after each pass, and optional passes that fail soft."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import opweave
from opweave import pipeline
from opweave.ir import Graph, TensorType
from opweave.ir.verify import VerificationError
from opweave.ir.text import parse_graph
from opweave.options import Options


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.fc1(x))) * 0.5, -1)


def _graph() -> Graph:
    g = Graph("tiny")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    w = g.add_constant("w", torch.randn(8, 8))
    g.outputs = [g.add1("relu", [g.add1("matmul", [g.add1("neg", [x]), w])])]
    return g


def test_every_pass_is_reported_in_order():
    g = _graph()
    w = g.constants["w"].clone()
    compiled = pipeline.compile_graph(g, Options(measure=False))
    names = [r.name for r in compiled.reports]
    assert names == [p.name for p in pipeline.GRAPH_PASSES] + ["lower"]
    assert all(r.seconds >= 0 and not r.failed for r in compiled.reports)
    assert compiled.report("rewrite") is not None
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x)[0], torch.relu(-x @ w))


def test_debug_dump_writes_the_ir_after_every_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("OPWEAVE_DEBUG", "1")
    monkeypatch.setenv("OPWEAVE_DEBUG_DIR", str(tmp_path))
    model, x = MLP().eval(), torch.randn(4, 8)
    compiled = opweave.compile(model, (x,), name="mlp")
    torch.testing.assert_close(compiled(x), model(x))
    (graph_dir,) = tmp_path.iterdir()
    files = sorted(p.name for p in graph_dir.iterdir())
    assert files == ["01-verify.ir", "02-rewrite.ir", "03-view-chains.ir", "04-gemm-layout.ir",
                     "05-batchnorm-affine.ir", "kernels.cpp", "partition.txt", "passes.txt"]
    for ir in graph_dir.glob("*.ir"):  # each dump is a complete graph that parses back
        parsed = parse_graph(ir.read_text())
        assert parsed.outputs
    timings = [line for line in (graph_dir / "passes.txt").read_text().splitlines()
               if not line.startswith(" ")]
    assert [line.split()[0] for line in timings] == ["verify", "rewrite", "view-chains",
                                                     "gemm-layout", "batchnorm-affine", "lower"]
    assert all(" ms " in line for line in timings)


def test_a_failing_optional_pass_warns_and_keeps_the_graph(monkeypatch):
    def broken(graph, options):
        raise RuntimeError("boom")

    passes = tuple(replace(p, run=broken) if p.name == "rewrite" else p
                   for p in pipeline.GRAPH_PASSES)
    monkeypatch.setattr(pipeline, "GRAPH_PASSES", passes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = pipeline.compile_graph(_graph(), Options(measure=False))
    assert any(issubclass(w.category, pipeline.PassWarning) and "rewrite pass failed" in str(w.message)
               and "boom" in str(w.message) for w in caught)
    (rewrite,) = [r for r in compiled.reports if r.name == "rewrite"]
    assert rewrite.failed == "RuntimeError: boom" and "skipped" in str(rewrite)


def test_a_pass_that_breaks_the_ir_is_caught_by_verification(monkeypatch):
    def corrupt(graph, options):
        graph.outputs = [graph.inputs[0], graph.nodes[-1].outputs[0]]
        graph.nodes[-1].inputs.append(graph.inputs[0])  # relu now has two inputs
        return graph, None

    monkeypatch.setattr(pipeline, "GRAPH_PASSES", (pipeline.Pass("corrupt", corrupt),))
    with pytest.raises(VerificationError):
        pipeline.compile_graph(_graph(), Options(measure=False))


def test_every_frontend_goes_through_the_driver(monkeypatch):
    seen = []
    original = pipeline.compile_graph

    def spy(graph, options):
        seen.append(graph.name)
        return original(graph, options)

    for module in ("opweave.frontends.program", "opweave.onnx.model"):
        monkeypatch.setattr(f"{module}.compile_graph", spy)
    model, x = MLP().eval(), torch.randn(4, 8)
    opweave.compile(model, (x,), name="exported")(x)
    torch.compile(model, backend="opweave")(x)
    opweave.from_onnx(opweave.to_onnx(opweave.compile(model, (x,)).graphs[0]))(x)
    assert any(n.startswith("exported") for n in seen)
    assert any(n.startswith("dynamo") for n in seen)
    assert len(seen) >= 4
