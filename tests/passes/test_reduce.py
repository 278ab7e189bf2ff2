"""Reduction elimination (the `reduce` rule set) on small graphs, before and after."""
from __future__ import annotations

import torch

from opweave.ir import Graph, TensorType
from opweave.passes.rewrite.pipeline import RewriteOptions, rewrite
from opweave.runtime import Executor

F32 = torch.float32


def _rewritten(g: Graph, *inputs):
    """The rewritten graph and its report, after checking it computes what `g` does."""
    after, report = rewrite(g, RewriteOptions())
    for e, a in zip(Executor(g)(*inputs), Executor(after)(*inputs)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    return after, report


def _reductions(g: Graph) -> list:
    return [n for n in g.nodes if n.op in ("sum", "mean", "amax", "amin")]


def test_sum_of_a_broadcast_becomes_a_multiplication():
    """The gradient of a broadcast bias, summed back over the broadcast axis."""
    g = Graph("bias_grad")
    x = g.add_input("x", TensorType((1, 8), F32))
    wide = g.add1("expand", [x], {"shape": [4, 8]})
    g.outputs = [g.add1("sum", [wide], {"dims": [0], "keepdim": False})]
    assert len(_reductions(g)) == 1
    after, report = _rewritten(g, torch.randn(1, 8))
    assert _reductions(after) == [] and "expand" not in after.op_counts()
    assert "sum-of-broadcast" in report.fired


def test_sum_over_the_unit_batch_axis_is_a_view():
    g = Graph("batch1")
    x = g.add_input("x", TensorType((1, 16, 8), F32))
    whole = g.add1("sum", [x], {"dims": [0, 1], "keepdim": False})
    row = g.add1("sum", [g.add1("exp", [x])], {"dims": [0], "keepdim": True})
    g.outputs = [whole, row]
    after, _ = _rewritten(g, torch.randn(1, 16, 8))
    (left,) = _reductions(after)  # the sum over the batch axis alone is gone
    assert 1 in left.attrs["dims"] and left.inputs[0] is after.inputs[0]
    assert after.outputs[1].producer.op == "exp"  # a sum over [1, 16, 8]'s axis 0 is x


def test_a_factor_constant_along_the_reduced_axis_moves_out_of_the_sum():
    """Layer norm's backward: sum(g * rstd) with rstd one per row."""
    g = Graph("scale_out")
    x = g.add_input("x", TensorType((32, 64), F32))
    rstd = g.add_input("rstd", TensorType((32, 1), F32))
    g.outputs = [g.add1("sum", [g.add1("mul", [x, rstd])], {"dims": [1], "keepdim": True})]
    after, report = _rewritten(g, torch.randn(32, 64), torch.rand(32, 1))
    (s,) = _reductions(after)
    assert s.inputs[0] is after.inputs[0], "the sum should read x itself"
    assert "sum-scale-out-right" in report.fired


def test_a_factor_that_varies_along_the_reduced_axis_stays_inside():
    g = Graph("no_scale_out")
    x = g.add_input("x", TensorType((32, 64), F32))
    w = g.add_input("w", TensorType((64,), F32))
    g.outputs = [g.add1("sum", [g.add1("mul", [x, w])], {"dims": [1], "keepdim": True})]
    after, report = _rewritten(g, torch.randn(32, 64), torch.randn(64))
    assert not any(r.startswith("sum-scale-out") for r in report.fired)
    (s,) = _reductions(after)
    assert s.inputs[0].producer.op == "mul"


def test_repeated_statistics_are_computed_once():
    g = Graph("stats_twice")
    x = g.add_input("x", TensorType((8, 32), F32))
    a = g.add1("mean", [x], {"dims": [1], "keepdim": True})
    b = g.add1("mean", [x], {"dims": [1], "keepdim": True})
    g.outputs = [g.add1("sub", [x, a]), g.add1("mul", [x, b])]
    assert len(_reductions(g)) == 2
    after, _ = _rewritten(g, torch.randn(8, 32))
    assert len(_reductions(after)) == 1


def test_a_sum_of_a_sum_is_one_sum():
    g = Graph("sum_sum")
    x = g.add_input("x", TensorType((2, 3, 4), F32))
    inner = g.add1("sum", [x], {"dims": [2], "keepdim": True})
    g.outputs = [g.add1("sum", [inner], {"dims": [0, 2], "keepdim": False})]
    after, report = _rewritten(g, torch.randn(2, 3, 4))
    (s,) = _reductions(after)
    assert sorted(s.attrs["dims"]) == [0, 2]
    assert "sum-of-sum" in report.fired


def test_a_column_sum_reads_through_the_reshape_to_its_producer():
    """A bias gradient: the sum of dY's rows, taken on the [tokens, features] view of the
    kernel output; after the rewrite it reads that output and can fuse with its kernel."""
    g = Graph("bias_grad_view")
    x = g.add_input("x", TensorType((2, 6, 8), F32))
    dy = g.add1("tanh", [x])
    rows = g.add1("reshape", [dy], {"shape": [12, 8]})
    total = g.add1("sum", [rows], {"dims": [0], "keepdim": True})
    g.outputs = [rows, g.add1("reshape", [total], {"shape": [8]})]  # as AOTAutograd writes it
    after, report = _rewritten(g, torch.randn(2, 6, 8))
    (s,) = _reductions(after)
    assert s.inputs[0].producer.op == "tanh" and sorted(s.attrs["dims"]) == [0, 1]
    assert "sum-through-reshape" in report.fired


def test_a_sum_of_a_reshape_to_a_scalar_is_left_alone():
    """Found by `opweave fuzz` (amin's gradient in a training step): sum-through-reshape
    indexed the last axis of a rank-0 reshape and crashed the rewrite pass."""
    g = Graph("scalar_view")
    x = g.add_input("x", TensorType((1, 1), F32))
    scalar = g.add1("reshape", [g.add1("exp", [x])], {"shape": []})
    g.outputs = [g.add1("sum", [scalar], {"dims": [], "keepdim": False})]
    after, report = _rewritten(g, torch.randn(1, 1))
    assert "sum-through-reshape" not in report.fired
