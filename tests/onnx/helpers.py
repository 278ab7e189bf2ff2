"""Small hand-built ONNX models for the frontend tests."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3) / 10


def mlp(batch="batch", opset=17, nodes=None, inputs=None, initializers=None) -> onnx.ModelProto:
    """Y = relu(X @ W): X [batch, 4] -> Y [batch, 3], nodes deliberately out of order."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, 3])
    nodes = nodes if nodes is not None else [
        helper.make_node("Relu", ["H"], ["Y"], name="relu"),
        helper.make_node("MatMul", ["X", "W"], ["H"], name="matmul")]
    inits = initializers if initializers is not None else [numpy_helper.from_array(WEIGHT, "W")]
    graph = helper.make_graph(nodes, "mlp", inputs or [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def mlp_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ WEIGHT, 0)
