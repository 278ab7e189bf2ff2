"""ONNX padding: the Pad operator in every mode, unequal (SAME_UPPER) padding of Conv,
MaxPool and AveragePool, and Clip's constant bounds as one clamp; each against the ONNX
reference evaluator."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import opweave
from opweave.bench.backends import export_onnx
from opweave.ir import padding
from opweave.onnx import OnnxUnsupported


def _model(nodes, x_shape, inits=(), inputs=None, opset=19) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", inputs or [x], [y], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _check(model, x, atol=1e-5):
    expected = ReferenceEvaluator(model).run(None, {"X": x})[0]
    imported = opweave.from_onnx(model)
    np.testing.assert_allclose(imported(x)[0], expected, rtol=1e-5, atol=atol)
    return imported


X = np.random.default_rng(0).standard_normal((2, 3, 5, 6)).astype(np.float32)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_in_every_mode_with_cropping_and_axes(mode):
    """H: 2 before, 1 cropped after; W: 1 cropped before, 3 after (numpy's np.pad is the
    reference evaluator's, which does not take negative counts)."""
    inits = [_ints("pads", [2, -1, -1, 3]), _ints("axes", [2, -1])]
    inputs = ["X", "pads"] + (["value", "axes"] if mode == "constant" else ["", "axes"])
    extra = {}
    if mode == "constant":
        inits.append(numpy_helper.from_array(np.array(1.5, dtype=np.float32), "value"))
        extra = {"constant_values": 1.5}
    model = _model([helper.make_node("Pad", inputs, ["Y"], mode=mode)], X.shape, inits)
    expected = np.pad(X[:, :, :-1, 1:], [(0, 0), (0, 0), (2, 0), (0, 3)], mode=mode, **extra)
    np.testing.assert_array_equal(opweave.from_onnx(model)(X)[0], expected)
    _check(_model([helper.make_node("Pad", ["X", "pads"], ["Y"], mode=mode)], X.shape,
                  [_ints("pads", [0, 1, 2, 0, 1, 0, 0, 3])]), X)


def test_positions_of_index_padding_match_numpy():
    for mode, numpy_mode in (("reflect", "reflect"), ("edge", "edge"), ("wrap", "wrap")):
        row = np.arange(5)
        expected = np.pad(row, (3, 2), mode=numpy_mode)
        assert padding.source_positions(5, 3, 2, mode) == expected.tolist(), mode
    with pytest.raises(ValueError, match="longer than both"):
        padding.source_positions(3, 3, 0, "reflect")


def test_pad_value_from_a_graph_input_specializes_and_one_computed_is_refused():
    v = helper.make_tensor_value_info("V", TensorProto.FLOAT, [])
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, list(X.shape))
    pads = _ints("pads", [0, 0, 1, 1, 0, 0, 1, 1])
    model = _model([helper.make_node("Pad", ["X", "pads", "V"], ["Y"])], X.shape, [pads],
                   inputs=[x, v])
    imported = opweave.from_onnx(model)
    for value in (2.0, -3.0):
        out = imported(X, np.array(value, dtype=np.float32))[0]
        np.testing.assert_array_equal(out, np.pad(X, [(0, 0), (0, 0), (1, 1), (1, 1)],
                                                  constant_values=value))
    computed = _model([helper.make_node("ReduceMax", ["X"], ["V"], keepdims=0),
                       helper.make_node("Pad", ["X", "pads", "V"], ["Y"])], X.shape, [pads])
    with pytest.raises(OnnxUnsupported, match="constant_value must be known"):
        opweave.from_onnx(computed).graph()


def _conv_model(auto_pad, stride, groups=1, channels=3):
    w = np.random.default_rng(1).standard_normal((4 * groups, channels // groups, 3, 3))
    b = np.random.default_rng(2).standard_normal(4 * groups)
    node = helper.make_node("Conv", ["X", "W", "B"], ["Y"], auto_pad=auto_pad,
                            strides=[stride, stride], group=groups)
    return _model([node], X.shape, [numpy_helper.from_array(w.astype(np.float32), "W"),
                                    numpy_helper.from_array(b.astype(np.float32), "B")])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_conv_with_unequal_same_padding(auto_pad):
    """Stride 2 on an even width pads one side only (TensorFlow's SAME): the shared part
    is the convolution's own padding, the rest an explicit pad before it."""
    imported = _check(_conv_model(auto_pad, 2), X, atol=1e-4)
    ops = [n.op for n in imported.graph().nodes]
    assert ops.count("cat") == 1 and ops.count("conv") == 1  # only W is unequal


def test_conv_with_explicit_unequal_pads():
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 2)).astype(np.float32)
    node = helper.make_node("Conv", ["X", "W"], ["Y"], pads=[0, 2, 1, 1])
    _check(_model([node], X.shape, [numpy_helper.from_array(w, "W")]), X, atol=1e-4)


@pytest.mark.parametrize("op,extra", [("MaxPool", {}),
                                      ("AveragePool", {"count_include_pad": 0}),
                                      ("AveragePool", {"count_include_pad": 1})])
def test_pooling_with_unequal_padding(op, extra):
    """MaxPool pads with -inf; AveragePool leaves the padding out of each window's count
    unless count_include_pad=1, as ONNX says (torch's default is the other way)."""
    x = -np.abs(X)  # all negative: a zero-padded max would show
    for attrs in ({"auto_pad": "SAME_UPPER", "strides": [2, 2]},
                  {"pads": [1, 0, 0, 1], "strides": [1, 2]}):
        node = helper.make_node(op, ["X"], ["Y"], kernel_shape=[3, 2], **attrs, **extra)
        _check(_model([node], x.shape), x)


def test_average_pool_with_equal_padding_excludes_it_by_default():
    node = helper.make_node("AveragePool", ["X"], ["Y"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    imported = _check(_model([node], X.shape), X)
    (pool,) = [n for n in imported.graph().nodes if n.op == "avg_pool2d"]
    assert pool.attrs["count_include_pad"] is False and pool.attrs["padding"] == [1, 1]


def test_pooling_refusals_name_the_reason():
    cases = [(dict(kernel_shape=[3, 3], pads=[0, 0, 1, 1], ceil_mode=1),
              r"ceil_mode=1 with padding \[0, 0, 1, 1\] the pooling cannot take"),
             (dict(kernel_shape=[2, 2], pads=[2, 0, 2, 0]), "a window could hold padding only")]
    for attrs, message in cases:
        model = _model([helper.make_node("AveragePool", ["X"], ["Y"], **attrs)], X.shape)
        with pytest.raises(OnnxUnsupported, match=message):
            opweave.from_onnx(model).graph()


def test_clip_with_constant_bounds_is_one_clamp():
    """ReLU6 as torch.onnx writes it: a clamp, which a convolution takes as its post-op."""
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
             for n, v in (("lo", 0.0), ("hi", 6.0))]
    x = X * 5
    for inputs, bounds in ((["X", "lo", "hi"], (0.0, 6.0)), (["X", "", "hi"], (None, 6.0))):
        imported = _check(_model([helper.make_node("Clip", inputs, ["Y"])], x.shape, inits), x)
        (clamp,) = [n for n in imported.graph().nodes if n.op not in ("input", "constant")]
        assert clamp.op == "clamp" and (clamp.attrs["min"], clamp.attrs["max"]) == bounds


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_mobilenet_style_padding_through_onnx_export(exporter, tmp_path):
    """torch.onnx's padding before a stride-2 depthwise convolution and ReLU6, from both
    exporters (the TorchScript one reverses its pad list with a negative-step Slice):
    equal padding is folded into the convolution, unequal stays a pad, and the result is
    eager's."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(8, 8, 3, stride=2, groups=8)
            self.conv2 = torch.nn.Conv2d(8, 8, 3)

        def forward(self, x):
            y = torch.nn.functional.relu6(self.conv(torch.nn.functional.pad(x, [0, 1, 0, 1])))
            return self.conv2(torch.nn.functional.pad(y, [1, 1, 1, 1]))

    block, x = Block().eval(), torch.randn(1, 8, 12, 12)
    path = str(tmp_path / "block.onnx")
    if exporter == "dynamo":
        export_onnx(block, (x,), path)
    else:
        torch.onnx.export(block, (x,), path, dynamo=False, opset_version=17)
    compiled = opweave.from_onnx(path)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x)[0], block(x), rtol=1e-5, atol=1e-5)
    ops = [n.op for n in compiled.graph().nodes]
    assert "clamp" in ops and ops.count("cat") == 2  # the unequal pad's H and W


@pytest.mark.parametrize("op, attrs", [
    ("MaxPool", dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    ("MaxPool", dict(kernel_shape=[3], dilations=[2], auto_pad="SAME_UPPER")),
    ("AveragePool", dict(kernel_shape=[4], strides=[3], pads=[1, 1], ceil_mode=1)),
    ("AveragePool", dict(kernel_shape=[3], pads=[1, 1], count_include_pad=1)),
])
def test_1d_pooling_runs_as_2d_pooling_over_a_unit_axis(op, attrs):
    x = np.random.default_rng(1).standard_normal((2, 3, 11)).astype(np.float32)
    model = _model([helper.make_node(op, ["X"], ["Y"], **attrs)], x.shape)
    imported = _check(model, x)
    pooling = {"MaxPool": "max_pool2d", "AveragePool": "avg_pool2d"}[op]
    assert [n.op for n in imported.graph().nodes].count(pooling) == 1
