"""`torch.compile(dynamic=True)` and `mark_dynamic`: one capture, one lowering to the
symbolic IR, a plan per distinct binding of the size symbols, outputs equal to eager."""
from __future__ import annotations

import pytest
import torch

from opweave.frontends import torch_dynamo
from opweave.ir.symbols import SymbolError
from opweave.ir.text import parse_graph
from opweave.models import build
from opweave.options import Options
from opweave.specializing import SymbolicGraph


def _programs_since(mark):
    return torch_dynamo.compiled_graphs.since(mark)


def test_dynamic_bert_compiles_once_for_every_sequence_length_and_batch():
    torch.manual_seed(0)
    model = build("bert-base", small=True).module.eval()
    torch._dynamo.reset()
    mark = torch_dynamo.compiled_graphs.mark()
    compiled = torch.compile(model, backend="opweave", dynamic=True)
    sizes = [(2, 8), (2, 12), (3, 16), (2, 8)]
    with torch.no_grad():
        for batch, seq in sizes:
            ids = torch.randint(0, 1000, (batch, seq))
            got, want = compiled(ids), model(ids)
            torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    programs = _programs_since(mark)
    assert len(programs) == 1, "Dynamo recompiled for a new size"
    program = programs[0]
    assert program.coverage.share == 1.0, program.coverage.fallback_message()
    families = program.symbolic_graphs
    assert families, "the captured graph lowered to no symbolic IR"
    # one plan per distinct (batch, seq): (2, 8) again reuses its plan
    assert max(f.compiles for f in families) == 3
    # the graph passes ran once, on the symbolic graph: every plan shares their report
    for family in families:
        assert family.per_binding is None
        assert len({id(plan.report("rewrite")) for plan in family.plans}) == 1


def test_mark_dynamic_batch_of_a_cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4)).eval()
    torch._dynamo.reset()
    mark = torch_dynamo.compiled_graphs.mark()
    compiled = torch.compile(model, backend="opweave")
    with torch.no_grad():
        for batch in (4, 3, 7):
            x = torch.randn(batch, 3, 10, 10)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    programs = _programs_since(mark)
    assert len(programs) == 1
    assert programs[0].coverage.share == 1.0, programs[0].coverage.fallback_message()
    assert [f.compiles for f in programs[0].symbolic_graphs] == [3]


def test_guard_failure_recompiles_for_another_rank():
    """A call outside what the dynamic graph covers (here, another rank) fails Dynamo's
    guards and is compiled again, not run on the wrong plan."""
    model = torch.nn.Linear(6, 5).eval()
    torch._dynamo.reset()
    mark = torch_dynamo.compiled_graphs.mark()
    compiled = torch.compile(model, backend="opweave", dynamic=True)
    with torch.no_grad():
        for x in (torch.randn(4, 6), torch.randn(9, 6), torch.randn(2, 3, 6)):
            torch.testing.assert_close(compiled(x), model(x))
    assert len(_programs_since(mark)) == 2


SYMBOLIC = """graph @g(%x: f32[s0, 8], %w: f32[8, 4]) {
  %y: f32[s0, 4] = matmul(%x, %w)
  %z: f32[s0, 4] = relu(%y)
  return %z
}"""


def test_symbolic_graph_keeps_one_plan_per_binding():
    family = SymbolicGraph(parse_graph(SYMBOLIC), Options.resolve())
    w = torch.randn(8, 4)
    for rows in (3, 5, 3):
        x = torch.randn(rows, 8)
        (out,) = family(x, w)
        torch.testing.assert_close(out, torch.relu(x @ w))
    assert family.compiles == 2 and len(family.plans) == 2


def test_symbolic_graph_names_the_input_a_binding_contradicts():
    family = SymbolicGraph(parse_graph(SYMBOLIC), Options.resolve())
    with pytest.raises(SymbolError, match=r"%w dim 0 is 7"):
        family(torch.randn(3, 8), torch.randn(7, 4))
    assert family.compiles == 0


def test_symbolic_graph_runs_every_pass_per_binding_where_they_fail_symbolically(monkeypatch):
    from opweave import pipeline

    def refuse_symbols(graph, options):
        if not all(v.type.is_static for v in graph.inputs):
            raise SymbolError("not over symbols")
        return graph, "ran"
    passes = tuple(pipeline.Pass(p.name, refuse_symbols, p.optional) if p.name == "rewrite"
                   else p for p in pipeline.GRAPH_PASSES)
    monkeypatch.setattr(pipeline, "GRAPH_PASSES", passes)
    family = SymbolicGraph(parse_graph(SYMBOLIC), Options.resolve())
    w = torch.randn(8, 4)
    for rows in (3, 5):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(family(x, w)[0], torch.relu(x @ w))
    assert "not over symbols" in family.per_binding
    assert [plan.report("rewrite") for plan in family.plans] == ["ran", "ran"]
