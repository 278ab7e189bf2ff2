"""IR -> ONNX edge cases: each exported graph passes onnx.checker and ONNX Runtime agrees
with the IR's reference implementation."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import opweave
from opweave.ir.graph import Graph
from opweave.ir.types import TensorType
from opweave.runtime.executor import Executor


def _agree(graph: Graph, *inputs: torch.Tensor) -> None:
    expected = Executor(graph)(*inputs)
    proto = opweave.to_onnx(graph)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)})
    for g, e in zip(got, expected):
        assert g.dtype == e.numpy().dtype and g.shape == tuple(e.shape)
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-6, atol=1e-6)


def test_reshape_to_a_zero_size_shape_keeps_the_zero():
    g = Graph("g")
    x = g.add_input("x", TensorType((0, 6), torch.float32))
    g.outputs = [g.add1("reshape", [x], {"shape": [0, 2, 3]})]
    _agree(g, torch.zeros(0, 6))


def test_any_over_an_empty_dim_is_false():
    g = Graph("g")
    x = g.add_input("x", TensorType((3, 0), torch.bool))
    g.outputs = [g.add1("any", [x], {"dims": [1]})]
    _agree(g, torch.zeros(3, 0, dtype=torch.bool))


def test_permute_of_a_scalar_exports():
    """Found by `opweave fuzz`: Transpose with an empty perm had no attribute type."""
    g = Graph("g")
    x = g.add_input("x", TensorType((), torch.float32))
    g.outputs = [g.add1("exp", [g.add1("permute", [x], {"dims": []})])]
    _agree(g, torch.tensor(0.5))


def test_integer_power_of_zero_to_a_negative_exponent_is_zero_as_in_torch():
    """Found by `opweave fuzz`: the round trip gave INT64_MIN (a float infinity cast)."""
    g = Graph("g")
    x = g.add_input("x", TensorType((5,), torch.int64))
    e = g.add_input("e", TensorType((5,), torch.int64))
    g.outputs = [g.add1("pow", [x, e])]
    x_, e_ = torch.tensor([0, 2, -2, 1, 3]), torch.tensor([-3, -1, -1, -3, 2])
    got = opweave.from_onnx(opweave.to_onnx(g))(x_, e_)[0]
    assert got.tolist() == torch.pow(x_, e_).tolist() == [0, 0, 0, 1, 9]


def test_integer_sum_and_exp_follow_torch_types():
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3), torch.int32))
    g.outputs = [g.add1("sum", [x], {"dims": [1]}), g.add1("exp", [x])]
    _agree(g, torch.arange(6, dtype=torch.int32).reshape(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_sign_ceil_and_floor_export_for_floats_and_integers(dtype):
    """ONNX's Ceil and Floor take floats only: an integer's rounding is an Identity."""
    g = Graph("g")
    x = g.add_input("x", TensorType((6,), dtype))
    g.outputs = [g.add1(op, [x]) for op in ("sign", "ceil", "floor")]
    _agree(g, torch.tensor([-2.5, -1.0, -0.0, 0.5, 2.0, 3.7]).to(dtype))


def test_generated_names_never_collide_with_ir_names():
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3), torch.float32))
    y = g.add1("reshape", [x], {"shape": [3, 2]}, name="shape__1")  # what the writer would pick
    g.outputs = [g.add1("reshape", [y], {"shape": [6]})]
    _agree(g, torch.randn(2, 3))


def test_scatter_with_a_larger_source_is_refused():
    g = Graph("g")
    x = g.add_input("x", TensorType((4,), torch.float32))
    index = g.add_constant("index", torch.tensor([0, 1]))
    src = g.add_input("src", TensorType((3,), torch.float32))
    g.outputs = [g.add1("scatter", [x, index, src], {"dim": 0})]
    with pytest.raises(opweave.onnx.OnnxExportError, match="larger than its index"):
        opweave.to_onnx(g)


def test_adaptive_max_pooling_to_an_empty_axis_is_refused_clearly():
    """Found by opweave fuzz: the exporter crashed with `max() arg is an empty sequence`."""
    from opweave.ir import parse_graph
    from opweave.onnx.export import OnnxExportError, export

    g = parse_graph("""graph @pool(%x: f32[3,1,3]) {
      %y: f32[3,5,0] = adaptive_max_pool2d(%x) {output_size=[5, 0], with_indices=false}
      return %y
    }""", {})
    with pytest.raises(OnnxExportError, match="empty axis"):
        export(g)


@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_exports_in_its_math_form(mask, causal):
    torch.manual_seed(0)
    g = Graph("g")
    q = g.add_input("q", TensorType((1, 2, 3, 4), torch.float32))
    k = g.add_input("k", TensorType((1, 2, 5, 4), torch.float32))
    v = g.add_input("v", TensorType((1, 2, 5, 4), torch.float32))
    inputs = [torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)]
    operands = [q, k, v]
    if mask != "none":
        dtype = torch.bool if mask == "bool" else torch.float32
        operands.append(g.add_input("m", TensorType((1, 1, 3, 5), dtype)))
        inputs.append(torch.rand(1, 1, 3, 5) < 0.7 if mask == "bool" else torch.randn(1, 1, 3, 5))
        if mask == "bool":
            inputs[-1][..., 0] = True  # no row wholly masked
    g.outputs = [g.add1("attention", operands, {"scale": 0.4, "causal": causal})]
    _agree(g, *inputs)
