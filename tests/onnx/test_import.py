"""ONNX import: node order, symbolic dims, opsets, external data, shape inputs, `run`."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import opweave
from opweave.cli import main
from opweave.onnx import OnnxError

from .helpers import mlp, mlp_reference


def test_nodes_in_any_order_and_symbolic_batch_bound_per_call():
    model = opweave.from_onnx(mlp())
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        np.testing.assert_allclose(model(x)[0], mlp_reference(x), rtol=1e-6, atol=1e-6)
    assert len(model._cache) == 2  # one specialization per distinct shape
    out = model(X=torch.ones(2, 4))[0]  # by name; tensors in, tensors out
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3)


def test_symbolic_dim_must_agree_across_inputs():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 3])
    z = helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["n", 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 3])
    graph = helper.make_graph([helper.make_node("Add", ["X", "Z"], ["Y"])], "g", [x, z], [y])
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(OnnxError, match=r"dimension 'n' is 3 in input 'Z' \(dim 0\) but 2 in input 'X'"):
        model(np.zeros((2, 3), np.float32), np.zeros((3, 3), np.float32))
    with pytest.raises(OnnxError, match=r"input 'X' dim 1 is 4, the model declares 3"):
        model(np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(OnnxError, match=r"dimension 'n' \(input 'X', dim 0\) is not known"):
        model.graph()
    assert model.graph({"n": 7}).inputs[0].type.shape == (7, 3)


def test_old_opset_is_upgraded_by_the_version_converter():
    # opset 11: Unsqueeze takes its axes as an attribute
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3])
    graph = helper.make_graph([helper.make_node("Unsqueeze", ["X"], ["Y"], axes=[0])], "g", [x], [y])
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]))
    assert model.opset >= 13
    np.testing.assert_array_equal(model(np.arange(3, dtype=np.float32))[0], [[0, 1, 2]])


def test_external_data_is_loaded_from_the_model_folder(tmp_path):
    proto = mlp()
    onnx.save_model(proto, tmp_path / "m.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    assert (tmp_path / "m.weights").exists()
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(opweave.from_onnx(tmp_path / "m.onnx")(x)[0], mlp_reference(x),
                               rtol=1e-6)


def test_shape_inputs_specialize_the_graph_to_their_values():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 6])
    s = helper.make_tensor_value_info("S", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Reshape", ["X", "S"], ["Y"])], "g", [x, s], [y])
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    data = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert model(data, np.array([3, 4]))[0].shape == (3, 4)
    assert model(data, np.array([-1, 2]))[0].shape == (6, 2)


def test_import_time_folding_of_shape_computations():
    """Shape -> Gather -> Concat -> Reshape, as exporters write a flatten: all folded."""
    nodes = [helper.make_node("Shape", ["X"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["X", "target"], ["Y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    graph_ir = model.graph({"b": 4})
    assert graph_ir.op_counts() == {"reshape": 1}
    assert graph_ir.outputs[0].type.shape == (4, 6)


def test_run_command_with_random_and_file_inputs(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    assert main(["run", str(path), "--random-missing", "--dim", "batch=3"]) == 0
    assert "Y: float32[3, 3]" in capsys.readouterr().out
    x = np.ones((2, 4), np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out.npz"
    assert main(["run", str(path), "-i", f"X={tmp_path / 'x.npy'}", "-o", str(out)]) == 0
    np.testing.assert_allclose(np.load(out)["Y"], mlp_reference(x), rtol=1e-6)
    np.savez(tmp_path / "in.npz", X=x)
    assert main(["run", str(path), "-i", str(tmp_path / "in.npz")]) == 0


def test_run_command_refuses_missing_inputs_unless_asked_for_random_ones(tmp_path, capsys):
    """An input absent from the .npz (a misspelt name, a forgotten file) used to be filled
    with random data, and the run exited 0."""
    path = tmp_path / "m.onnx"
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["Y"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("A", "B")],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    np.savez(tmp_path / "in.npz", A=np.ones((2, 3), np.float32))
    out = tmp_path / "out.npz"
    assert main(["run", str(path), "-i", str(tmp_path / "in.npz"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opweave: error:") and "model input(s) B" in err
    assert "--random-missing" in err and "Traceback" not in err and not out.exists()
    assert main(["run", str(path)]) == 2
    assert "model input(s) A, B" in capsys.readouterr().err
    assert main(["run", str(path), "-i", str(tmp_path / "in.npz"), "--random-missing",
                 "-o", str(out)]) == 0
    assert np.load(out)["Y"].shape == (2, 3)


def test_run_command_names_the_missing_dimension(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    assert main(["run", str(path), "--random-missing"]) == 2
    err = capsys.readouterr().err
    assert "dimension 'batch' (input 'X', dim 0) is not known" in err
    assert "Traceback" not in err


def test_outputs_never_alias_inputs_or_weights():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [6])
    shape = numpy_helper.from_array(np.array([6], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("Reshape", ["X", "shape"], ["Y"])], "g", [x], [y],
                              [shape])
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    data = np.ones((2, 3), np.float32)
    out = model(data)[0]
    out[0] = 42.0
    assert data[0, 0] == 1.0


def test_an_unsupported_optional_output_is_refused_by_position():
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1, 4, 4])
    i = helper.make_tensor_value_info("I", TensorProto.INT64, None)
    node = helper.make_node("MaxPool", ["X"], ["", "I"], kernel_shape=[2, 2], name="pool")
    graph = helper.make_graph([node], "g", [x], [i])
    model = opweave.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(opweave.onnx.OnnxUnsupported, match="node 'pool'.*output 1"):
        model(np.zeros((1, 1, 4, 4), np.float32))


def test_output_file_gets_exactly_the_given_name(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(mlp(), path)
    assert main(["run", str(path), "--random-missing", "--dim", "batch=2", "-o",
                 str(tmp_path / "result.bin")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "result.bin"]
    assert np.load(tmp_path / "result.bin")["Y"].shape == (2, 3)
