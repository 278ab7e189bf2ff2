"""The verifier accepts well-formed graphs and names the problem in malformed ones."""
from __future__ import annotations

import pytest
import torch

from opweave.ir import Graph, TensorType, VerificationError, parse_graph, verify
from opweave.ir.graph import Node, Value


def _graph():
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3), torch.float32))
    w = g.add_constant("w", torch.randn(3, 4))
    y = g.add1("matmul", [x, w], name="y")
    z = g.add1("relu", [y], name="z")
    g.outputs = [z]
    return g


def test_well_formed_graph_passes():
    assert verify(_graph()) is not None


def test_wrong_declared_shape():
    text = str(_graph()).replace("%z: f32[2,4]", "%z: f32[2,5]")
    g = parse_graph(text, _graph().constants)
    with pytest.raises(VerificationError, match=r"node 2 \(%z = relu\): declared output types \(f32\[2,5\]\)"):
        verify(g)


def test_shape_rule_failure_names_node():
    text = str(_graph()).replace("%x: f32[2,3]", "%x: f32[2,7]")
    with pytest.raises(VerificationError, match=r"node 1 \(%y = matmul\): matmul: inner dims differ"):
        verify(parse_graph(text, _graph().constants))


def test_cycle_is_reported():
    g = _graph()
    matmul, relu = g.nodes[1], g.nodes[2]
    matmul.inputs[0] = relu.outputs[0]  # y = matmul(z, w); z = relu(y)
    with pytest.raises(VerificationError, match=r"cyclic or out of topological order\); cycle: (%y -> %z|%z -> %y)"):
        verify(g)


def test_out_of_order_nodes_are_reported():
    g = _graph()
    g.nodes[1], g.nodes[2] = g.nodes[2], g.nodes[1]
    with pytest.raises(VerificationError, match=r"input %y is produced by node 2, which does not come before it"):
        verify(g)


def test_undefined_input_and_output():
    g = _graph()
    stray = Value("stray", TensorType((2, 4), torch.float32))
    g.nodes[2].inputs = [stray]
    with pytest.raises(VerificationError, match=r"input %stray is not defined"):
        verify(g)
    g = _graph()
    g.outputs = [Value("ghost", TensorType((1,), torch.float32))]
    with pytest.raises(VerificationError, match=r"graph output %ghost is not defined"):
        verify(g)


def test_unknown_op_arity_and_attributes():
    g = _graph()
    g.nodes[2].op = "frobnicate"
    with pytest.raises(VerificationError, match=r"unknown op 'frobnicate'"):
        verify(g)
    g = _graph()
    g.nodes[2].inputs.append(g.inputs[0])
    with pytest.raises(VerificationError, match=r"relu\): takes 1 inputs, got 2"):
        verify(g)
    g = _graph()
    g.nodes[1].attrs["alpha"] = 2
    with pytest.raises(VerificationError, match=r"unknown \['alpha'\]"):
        verify(g)
    g = _graph()
    s = g.add1("softmax", [g.outputs[0]], {"dim": 1})
    s.producer.attrs["dim"] = "one"
    with pytest.raises(VerificationError, match=r"attribute dim='one' is not of kind int"):
        verify(g)


def test_constant_without_data_or_with_wrong_data():
    g = _graph()
    g.constants.clear()
    with pytest.raises(VerificationError, match=r"constant 'w' has no data"):
        verify(g)
    g = _graph()
    g.constants["w"] = torch.randn(3, 5)
    with pytest.raises(VerificationError, match=r"constant 'w' holds f32\[3,5\], declared f32\[3,4\]"):
        verify(g)


def test_value_defined_twice():
    g = _graph()
    node = Node("relu", [g.inputs[0]], {}, [])
    node.outputs = [Value("y", TensorType((2, 3), torch.float32), node)]
    g.nodes.append(node)
    with pytest.raises(VerificationError, match=r"value %y is defined twice"):
        verify(g)
