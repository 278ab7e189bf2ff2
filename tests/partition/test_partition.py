"""The partitioner: roles, legality with reasons, ILP vs greedy, the structural cache."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from opweave.codegen.render import FUSIBLE
from opweave.ir import Graph, TensorType
from opweave.partition import Role, partition
from opweave.partition.context import Context
from opweave.partition.legality import why_illegal

from .graphs import attention_scores, mlp_block, stacked_mlp


def _fused_ops(part) -> Counter:
    return Counter(tuple(n.op for n in part.ordered(g)) for g in part.fused)


def test_roles_follow_mapping_types():
    g = mlp_block()
    ctx = Context(g, FUSIBLE)
    roles = Counter(ctx.role[n] for n in ctx.nodes)
    assert roles[Role.ANCHOR] == 2          # the two linears
    assert roles[Role.ROW_REDUCE] == 1      # layer norm
    assert ctx.reason[next(n for n in ctx.nodes if n.op == "permute")] == "a view moves no data"


def test_ilp_fuses_mlp_block():
    part = partition(mlp_block(), "ilp", FUSIBLE)
    fused = _fused_ops(part)
    assert fused[("matmul", "add", "gelu")] == 1
    # the residual add joins either the second linear's post-ops or the layer norm kernel
    assert (fused[("matmul", "add", "reshape", "add")] + fused[("add", "layer_norm")]) == 1
    covered = [n for g in part.groups for n in g]
    assert len(covered) == len(set(covered)) == len(part.ctx.nodes)


def test_greedy_cannot_pass_an_illegal_intermediate_group():
    """matmul+add+reshape is not a legal group (an epilogue cannot end in a view), so
    greedy never reaches matmul+add+reshape+add; the ILP sees whole candidates."""
    g = mlp_block()
    ilp, greedy = partition(g, "ilp", FUSIBLE), partition(g, "greedy", FUSIBLE)
    assert ("matmul", "add", "reshape", "add") not in _fused_ops(greedy)
    assert ilp.estimated_seconds() <= greedy.estimated_seconds() + 1e-12


def test_row_reduction_takes_its_prologue():
    part = partition(attention_scores(), "ilp", FUSIBLE)
    assert _fused_ops(part) == Counter({("mul", "add", "softmax"): 1})


def test_refusals_say_why():
    g = mlp_block()
    ctx = Context(g, FUSIBLE)
    by_op = {}
    for n in ctx.nodes:
        by_op.setdefault(n.op, []).append(n)
    mm1, mm2 = by_op["matmul"]
    assert why_illegal(ctx, frozenset([mm1, mm2])) == "two contractions in one kernel"
    ln = by_op["layer_norm"][0]
    gelu = by_op["gelu"][0]
    assert "iteration spaces" in why_illegal(ctx, frozenset([gelu, ln]))


def test_column_sum_joins_its_producer_but_nothing_reads_it_inside():
    """A bias gradient: the kernel that computes dY also sums its columns."""
    g = Graph("colsum")
    x = g.add_input("x", TensorType((1, 6, 4), torch.float32))
    a = g.add1("exp", [x])
    b = g.add1("sum", [a], {"dims": [0, 1], "keepdim": False})
    c = g.add1("mul", [a, b])                # reads the finished sums: another kernel
    g.outputs = [c]
    ctx = Context(g, FUSIBLE)
    assert ctx.role[b.producer] is Role.COLUMN_SUM
    assert "read inside its kernel" in why_illegal(ctx, frozenset([a.producer, b.producer,
                                                                   c.producer]))
    assert _fused_ops(partition(g, "ilp", FUSIBLE)) == Counter({("exp", "sum"): 1})


def test_non_convex_group_is_refused():
    """a -> b -> c and a -> c: {a, c} without b would need its own output."""
    g = Graph("diamond")
    x = g.add_input("x", TensorType((4, 4), torch.float32))
    a = g.add1("exp", [x])
    b = g.add1("sum", [a], {"dims": [1], "keepdim": False})  # dropping its axis: torch
    c = g.add1("add", [a, b])
    g.outputs = [c]
    ctx = Context(g, FUSIBLE)
    na, nc = a.producer, c.producer
    assert "re-enters" in why_illegal(ctx, frozenset([na, nc]))
    part = partition(g, "ilp", FUSIBLE)
    assert part.fused == []


def test_repeated_blocks_are_solved_once():
    part = partition(stacked_mlp(layers=4), "ilp", FUSIBLE)
    assert part.components >= 4
    assert part.cache_hits >= 3


def test_a_solution_is_not_taken_for_other_costs():
    """Solved under one price of float32 kernels (`conversion_seconds`, keyed by `costs`),
    a component is solved again under another: a bf16 compile after a float32 one in the
    same process had taken the float32 cover."""
    plain = partition(mlp_block(), "ilp", FUSIBLE)
    assert plain.fused  # the norm and the add fuse when kernels cost only their traffic
    priced = partition(mlp_block(), "ilp", FUSIBLE, costs=("bf16",),
                       conversion_seconds=lambda ctx, g: 1.0 if len(g) > 1 else 0.0)
    assert priced.cache_hits == 0 and priced.fused == []
    again = partition(mlp_block(), "ilp", FUSIBLE)
    assert again.cache_hits >= 1 and len(again.fused) == len(plain.fused)


@pytest.mark.parametrize("method", ["ilp", "greedy"])
def test_every_node_is_covered_once(method):
    part = partition(stacked_mlp(layers=2), method, FUSIBLE)
    covered = [n for g in part.groups for n in g]
    assert sorted(map(id, covered)) == sorted(map(id, part.ctx.nodes))


def test_why_alone_names_the_blocking_reason():
    g = mlp_block()
    part = partition(g, "ilp", FUSIBLE)
    permute = next(n for n in part.ctx.nodes if n.op == "permute")
    assert part.why_alone(permute) == "a view moves no data"


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown partitioner"):
        partition(mlp_block(), "magic", FUSIBLE)


def test_overlong_rows_stay_in_torch():
    g = Graph("long")
    x = g.add_input("x", TensorType((2, 20000), torch.float32))
    g.outputs = [g.add1("softmax", [g.add1("exp", [x])], {"dim": 1})]
    ctx = Context(g, FUSIBLE)
    softmax = g.outputs[0].producer
    assert ctx.role[softmax] is Role.OPAQUE and "longer than" in ctx.reason[softmax]
