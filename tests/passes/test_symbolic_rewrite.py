"""The rewrite pass on a graph of symbolic sizes, which specializing.py runs once for every
size: ops are costed at the sizes given (`cost.at_sizes`), a rule whose side condition
sympy cannot decide refuses, and the rewritten graph computes what the original does at
every binding, sizes of 1 included; once specialized, what the sizes made constant folds."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opweave import cost
from opweave.ir import Graph, TensorType
from opweave.ir.specialize import specialize
from opweave.ir.symbols import SymbolError, symbol
from opweave.passes.fold import fold_constants
from opweave.passes.rewrite.pipeline import rewrite
from opweave.passes.rewrite.rule import RULES, Builder, Reject
from opweave.passes.rewrite.term import Store, from_graph
from opweave.runtime import Executor

F32 = torch.float32
S0, S1 = symbol("s0"), symbol("s1")


def _graph() -> Graph:
    """BERT's patterns over (s0, s1, 8) activations: two projections of one input (merged),
    a reshape of a reshape, a full slice, and a sum over a broadcast of symbolic length
    (its rewrite scales by that length, `float(s0)`: it must refuse)."""
    torch.manual_seed(0)
    g = Graph("sym")
    x = g.add_input("x", TensorType((S0, S1, 8), F32))
    flat = g.add1("reshape", [x], {"shape": [S0 * S1, 8]})
    outs = []
    for name in "ab":
        w = g.add_constant(f"w_{name}", torch.randn(8, 8))
        b = g.add_constant(f"b_{name}", torch.randn(8))
        outs.append(g.add1("add", [g.add1("matmul", [flat, w]), b]))
    a3 = g.add1("reshape", [outs[0]], {"shape": [S0, S1, 8]})
    a2 = g.add1("reshape", [a3], {"shape": [S0 * S1, 8]})
    whole = g.add1("slice", [a2], {"dim": 0, "start": 0, "end": S0 * S1, "step": 1})
    row = g.add1("reshape", [g.add1("relu", [outs[1]])], {"shape": [S0, S1, 8]})
    first = g.add1("slice", [row], {"dim": 0, "start": 0, "end": 1, "step": 1})
    spread = g.add1("expand", [first], {"shape": [S0, S1, 8]})
    total = g.add1("sum", [spread], {"dims": [0], "keepdim": False})
    g.outputs = [whole, total]
    return g


def test_a_symbolic_graph_rewritten_once_computes_the_same_at_every_binding():
    g = _graph()
    with cost.at_sizes({"s0": 4, "s1": 16}):
        new, report = rewrite(g)
    assert "merge-linear" in report.fired and len(new.nodes) < len(g.nodes), report
    assert "sum-of-broadcast" not in report.fired
    for s0, s1 in [(1, 1), (4, 16), (3, 5)]:
        x = torch.randn(s0, s1, 8)
        binding = {"s0": s0, "s1": s1}
        want = Executor(specialize(g, binding))(x)
        got = Executor(specialize(new, binding))(x)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_symbolic_sizes_are_costed_at_the_sizes_given_or_not_at_all():
    ins = [TensorType((S0, 8), F32), TensorType((8, 8), F32)]
    out = [TensorType((S0, 8), F32)]
    with pytest.raises(SymbolError, match="no sizes to cost it at"):
        cost.node_seconds("matmul", ins, out, {})
    concrete = cost.node_seconds("matmul", [TensorType((64, 8), F32), ins[1]],
                                 [TensorType((64, 8), F32)], {})
    with cost.at_sizes({"s0": 64}):
        assert cost.node_seconds("matmul", ins, out, {}) == concrete


def test_an_undecidable_side_condition_refuses_only_over_symbolic_sizes():
    """A rule's TypeError is a sympy question without an answer (`float(s0)`) when sizes
    are symbolic, and a bug otherwise: it refuses in the first case and raises in the
    second."""
    def builder(graph: Graph) -> Builder:
        store = Store()
        dag = from_graph(graph, store)
        return Builder(dag, dag, store, "test")

    def undecided(b, m):
        raise TypeError("cannot determine truth value of Relational")
    odd = replace(RULES["reshape-reshape"], rhs=undecided)
    with pytest.raises(Reject, match="needs concrete sizes"):
        odd.apply(builder(_graph()), None)
    with pytest.raises(TypeError):
        odd.apply(builder(specialize(_graph(), {"s0": 2, "s1": 3})), None)


def test_specialized_values_of_the_sizes_fold_and_views_of_weights_stay_views():
    """A slice of a constant table to a symbolic length (BERT's position ids), and the rows
    it selects, become constants once the length is known; a weight's transposed view
    stays a view (folding it would copy the weight into every plan)."""
    torch.manual_seed(0)
    g = Graph("positions")
    x = g.add_input("x", TensorType((S0, 8), F32))
    ids = g.add_constant("ids", torch.arange(16))
    table = g.add_constant("table", torch.randn(16, 8))
    weight = g.add1("permute", [g.add_constant("w", torch.randn(8, 8))], {"dims": [1, 0]})
    positions = g.add1("index_select", [table, g.add1("slice", [ids], {
        "dim": 0, "start": 0, "end": S0, "step": 1})], {"dim": 0})
    g.outputs = [g.add1("matmul", [g.add1("add", [x, positions]), weight])]
    concrete = specialize(g, {"s0": 5})
    folded, count = fold_constants(concrete)
    assert count == 1 and [n.op for n in folded.nodes if n.op != "constant"] == \
        ["permute", "add", "matmul"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(Executor(folded)(x)[0], Executor(concrete)(x)[0])
