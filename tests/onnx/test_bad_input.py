"""Bad ONNX input: one clear error naming the problem and the node or file."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import opweave
from opweave.cli import main
from opweave.onnx import OnnxError, OnnxUnsupported

from .helpers import mlp


def _error(source) -> str:
    with pytest.raises(OnnxError) as info:
        opweave.from_onnx(source)(np.ones((2, 4), np.float32))
    return str(info.value)


def test_truncated_file(tmp_path):
    path = tmp_path / "cut.onnx"
    path.write_bytes(mlp().SerializeToString()[:-7])
    message = _error(path)
    assert str(path) in message and "not a valid ONNX file" in message and "truncated" in message


def test_file_that_is_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("these are my notes, not a model\n" * 3)
    assert str(path) in _error(path)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert "not an ONNX model" in _error(empty)


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes(tmp_path, seed):
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(seed).bytes(int(16 + 300 * seed)))
    assert str(path) in _error(path)


def test_damaged_bytes_in_a_valid_model():
    """Byte flips that protobuf still parses: a name that is not UTF-8 (protobuf hands back
    bytes), a node whose input list is cut off."""
    data = mlp().SerializeToString()
    damaged = data.replace(b"\n\x01X", b"\n\x01\xfc", 1)  # the matmul's input X -> b"\xfc"
    assert "value name in node 'matmul' (MatMul) b'\\xfc' is not valid UTF-8" in _error(damaged)
    no_input = mlp(nodes=[helper.make_node("Relu", [], ["Y"], name="relu")])
    message = _error(no_input)
    assert "node 'relu' (Relu) has 0 input(s)" in message and "takes 1" in message
    empty_required = mlp(nodes=[helper.make_node("MatMul", ["X", ""], ["H"], name="mm"),
                                helper.make_node("Relu", ["H"], ["Y"])])
    assert "node 'mm' (MatMul): input 1 is required by MatMul but left empty" in \
        _error(empty_required)


@pytest.mark.parametrize("cut", [4, 3])
def test_initializer_data_shorter_than_its_dims(cut):
    model = mlp()
    (weight,) = model.graph.initializer
    weight.raw_data = weight.raw_data[:-cut]
    message = _error(model)
    assert f"initializer 'W': raw data of tensor 'W' has {48 - cut} bytes" in message
    assert "dims [4, 3] of float32 need 48" in message


def test_initializer_dims_larger_than_its_data():
    model = mlp()
    model.graph.initializer[0].dims[0] = 5
    assert "has 48 bytes, but its dims [5, 3] of float32 need 60" in _error(model)


def test_future_opset():
    message = _error(mlp(opset=99))
    assert "uses opset 99 of the default domain" in message
    assert f"newest the installed onnx {onnx.__version__} defines" in message


def test_missing_file(tmp_path):
    assert "no such file" in _error(tmp_path / "absent.onnx")


def test_cycle_names_the_nodes():
    nodes = [helper.make_node("Relu", ["B"], ["A"], name="first"),
             helper.make_node("Relu", ["A"], ["B"], name="second"),
             helper.make_node("MatMul", ["X", "W"], ["H"], name="matmul"),
             helper.make_node("Add", ["H", "A"], ["Y"], name="add")]
    message = _error(mlp(nodes=nodes))
    assert "cycle" in message and "'first'" in message and "'second'" in message


def test_undefined_input_names_node_and_value():
    nodes = [helper.make_node("MatMul", ["X", "W"], ["H"], name="matmul"),
             helper.make_node("Add", ["H", "ghost"], ["Y"], name="add")]
    message = _error(mlp(nodes=nodes))
    assert "node 'add' (Add) reads 'ghost'" in message


def test_unknown_op_names_the_node():
    nodes = [helper.make_node("MatMul", ["X", "W"], ["H"], name="matmul"),
             helper.make_node("FancyActivation", ["H"], ["Y"], name="fancy")]
    with pytest.raises(OnnxUnsupported, match=r"node 'fancy' \(FancyActivation\).*not supported"):
        opweave.from_onnx(mlp(nodes=nodes))
    custom = [helper.make_node("MatMul", ["X", "W"], ["H"]),
              helper.make_node("Gelu", ["H"], ["Y"], name="g", domain="com.example")]
    with pytest.raises(OnnxUnsupported, match="domain 'com.example'"):
        opweave.from_onnx(mlp(nodes=custom))


def test_missing_external_data_file(tmp_path):
    onnx.save_model(mlp(), tmp_path / "m.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    (tmp_path / "m.weights").unlink()
    message = _error(tmp_path / "m.onnx")
    assert "external data file 'm.weights' of tensor 'W' is missing" in message


def test_truncated_external_data_file(tmp_path):
    onnx.save_model(mlp(), tmp_path / "m.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.weights", size_threshold=0)
    data = (tmp_path / "m.weights").read_bytes()
    (tmp_path / "m.weights").write_bytes(data[:10])
    assert "tensor 'W'" in _error(tmp_path / "m.onnx")


def test_wrong_input_dtype_and_count():
    model = opweave.from_onnx(mlp())
    with pytest.raises(OnnxError, match="input 'X' has dtype torch.float64"):
        model(np.ones((2, 4)))
    with pytest.raises(OnnxError, match="missing input"):
        model()
    with pytest.raises(OnnxError, match="no input named 'Q'"):
        model(Q=np.ones((2, 4), np.float32))


def test_cli_reports_one_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"\x08\x07garbage")
    assert main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opweave: error:") and "Traceback" not in err and str(path) in err


def test_export_failure_leaves_no_file(tmp_path):
    from opweave.ir.graph import Graph
    from opweave.ir.types import TensorType
    import torch

    graph = Graph("g")
    x = graph.add_input("x", TensorType((4,), torch.float32))
    graph.outputs = graph.add("dropout", [x], {"p": 0.5})[:1]  # random: no ONNX form here
    with pytest.raises(opweave.onnx.OnnxExportError, match="dropout"):
        opweave.to_onnx(graph, tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []
