"""The mask encoding's reordering (schedule/remat/masks.py) on hand-built graphs."""
from __future__ import annotations

import torch

from opweave.ir import Graph, TensorType
from opweave.schedule.remat.masks import hoist_masks


def _relu_graph(read_late: bool):
    """relu's output read by a forward op, then (late) by `le(relu, 0)`, and optionally
    by one more op after the comparison; the zero constant is made late."""
    g = Graph("masks")
    x = g.add_input("x", TensorType((64, 64), torch.float32))
    grad = g.add_input("grad", TensorType((64, 64), torch.float32))
    relu = g.add1("relu", [x])
    forward = g.add1("tanh", [relu])
    late = g.add1("exp", [forward])
    zero = g.add_constant("zero", torch.zeros(()))
    mask = g.add1("le", [relu, zero])
    out = g.add1("where", [mask, zero, grad])
    g.outputs = [late, out]
    if read_late:
        g.outputs.append(g.add1("neg", [relu]))
    return g, mask.producer, relu.producer


def test_a_comparison_moves_up_to_just_after_the_value_with_its_constant():
    g, comparison, relu = _relu_graph(read_late=False)
    assert hoist_masks(g) == [comparison]
    at = g.nodes.index(relu)
    assert g.nodes[at + 2] is comparison and g.nodes[at + 1].op == "constant"
    seen = set(g.inputs)
    for node in g.nodes:  # still in a topological order
        assert all(v in seen for v in node.inputs)
        seen.update(node.outputs)


def test_a_value_read_after_the_comparison_is_left_alone():
    g, _, _ = _relu_graph(read_late=True)
    order = list(g.nodes)
    assert hoist_masks(g) == []
    assert g.nodes == order
