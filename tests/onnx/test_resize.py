"""ONNX Resize, Upsample and ConvTranspose: torch's forms where the modes are torch's, the
separable index form for every other mode, ConvTranspose's padding torch cannot take;
each against the ONNX reference evaluator. And the IR ops written back as ONNX."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import opweave
from opweave.ir.graph import Graph
from opweave.ir.types import TensorType
from opweave.onnx import OnnxUnsupported
from opweave.runtime.executor import Executor

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 5, 6)).astype(np.float32)


def _model(nodes, x_shape, inits=(), opset=19) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "g", [x], [y], list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _resize(x_shape, scales=None, sizes=None, axes=None, **attrs) -> onnx.ModelProto:
    inits, inputs = [], ["X", "", "", ""]
    if scales is not None:
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
        inputs[2] = "scales"
    if sizes is not None:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        inputs[3] = "sizes"
    if axes is not None:
        attrs["axes"] = axes
    node = helper.make_node("Resize", inputs[:4 if sizes is not None else 3], ["Y"], **attrs)
    return _model([node], x_shape, inits)


def _check(model, x, atol=1e-5) -> list[str]:
    """The imported model's IR ops, after checking its output against the reference."""
    expected = ReferenceEvaluator(model).run(None, {"X": x})[0]
    imported = opweave.from_onnx(model)
    got = imported(x)[0]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=atol)
    return [n.op for n in imported.graph().nodes if n.op not in ("input", "constant")]


@pytest.mark.parametrize("case", [
    dict(scales=[1, 1, 2, 3], mode="nearest", coordinate_transformation_mode="asymmetric",
         nearest_mode="floor"),
    dict(sizes=[2, 3, 10, 18], mode="nearest", coordinate_transformation_mode="asymmetric",
         nearest_mode="floor"),
    dict(scales=[1, 1, 2, 2], mode="linear"),  # half_pixel, ONNX's default
    dict(scales=[1, 1, 0.6, 1.7], mode="linear"),
    dict(sizes=[2, 3, 7, 4], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    dict(sizes=[2, 3, 9, 13], mode="linear", coordinate_transformation_mode="align_corners"),
    dict(scales=[1, 1, 2, 2], mode="linear", coordinate_transformation_mode="align_corners"),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_torch_modes_run_as_torch_upsampling(case):
    ops = _check(_resize(X.shape, **case), X)
    assert ops == ["upsample_nearest2d" if case["mode"] == "nearest" else "upsample_bilinear2d"]


@pytest.mark.parametrize("case", [
    dict(scales=[1, 1, 2, 3], mode="nearest"),  # half_pixel, round_prefer_floor
    dict(scales=[1, 1, 0.5, 0.7], mode="nearest", nearest_mode="round_prefer_ceil"),
    dict(sizes=[2, 3, 8, 4], mode="nearest", coordinate_transformation_mode="align_corners",
         nearest_mode="ceil"),
    dict(scales=[1, 1, 1.5, 2], mode="nearest", coordinate_transformation_mode="asymmetric",
         nearest_mode="floor"),  # a factor that is not whole: torch rounds 1 / 1.5 in float32
    dict(scales=[1, 1, 2, 0.5], mode="linear", coordinate_transformation_mode="asymmetric"),
    dict(scales=[1, 1, 0.6, 0.6], mode="linear", coordinate_transformation_mode="align_corners"),
    dict(scales=[1, 1, 1.8, 1.3], mode="linear",
         coordinate_transformation_mode="half_pixel_symmetric"),
    dict(scales=[1, 1, 2, 1.5], mode="linear", exclude_outside=1),
    dict(scales=[1, 1, 2, 1.5], mode="cubic"),
    dict(scales=[1, 1, 0.8, 2.5], mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1),
    dict(sizes=[4, 3], axes=[3, 2], mode="cubic", coordinate_transformation_mode="asymmetric"),
    dict(sizes=[4, 3, 5, 6], mode="nearest"),  # the batch axis
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_other_modes_run_as_picked_and_weighted_positions(case):
    ops = _check(_resize(X.shape, **case), X)
    assert "index_select" in ops and not any(op.startswith("upsample") for op in ops)


def test_resize_of_a_3d_input_and_upsample_of_opset_9():
    x = RNG.standard_normal((2, 4, 7)).astype(np.float32)
    ops = _check(_resize(x.shape, scales=[1, 1, 2.5], mode="linear"), x)
    assert ops.count("index_select") == 2
    scales = numpy_helper.from_array(np.array([1, 1, 2, 3], np.float32), "scales")
    upsample = _model([helper.make_node("Upsample", ["X", "scales"], ["Y"], mode="nearest")],
                      X.shape, [scales], opset=9)
    expected = X.repeat(2, axis=2).repeat(3, axis=3)
    np.testing.assert_array_equal(opweave.from_onnx(upsample)(X)[0], expected)


@pytest.mark.parametrize("attrs, message", [
    (dict(scales=[1, 1, 0.5, 0.5], mode="linear", antialias=1), "antialias=1"),
    (dict(scales=[1, 1, 2, 2], mode="linear",
          coordinate_transformation_mode="tf_crop_and_resize"), "tf_crop_and_resize"),
    (dict(scales=[1, 1, 2, 2], mode="bicubic"), "mode='bicubic'"),
    (dict(scales=[1, 1, 2], mode="linear"), "3 scales for axes"),
])
def test_what_resize_does_not_do_is_refused_by_name(attrs, message):
    with pytest.raises(OnnxUnsupported, match=message):
        opweave.from_onnx(_resize(X.shape, **attrs)).graph()


def test_a_size_known_per_call_is_resized_symbolically_by_whole_factors_only():
    """By a whole factor the model is lowered once for every size; by any other, where
    the taps depend on the size, once per size (said once), and still right."""
    def model(scales):
        x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, "h", "w"])
        y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
        inits = [numpy_helper.from_array(np.array(scales, np.float32), "scales")]
        node = helper.make_node("Resize", ["X", "", "scales"], ["Y"], mode="linear")
        return helper.make_model(helper.make_graph([node], "g", [x], [y], inits),
                                 opset_imports=[helper.make_opsetid("", 19)])

    for scales, lowerings in (([1, 1, 2, 2], 1), ([1, 1, 1.5, 2], 2)):
        proto = model(scales)
        imported = opweave.from_onnx(proto)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for h, w in ((5, 4), (3, 7)):
                x = RNG.standard_normal((1, 2, h, w)).astype(np.float32)
                np.testing.assert_allclose(imported(x)[0],
                                           ReferenceEvaluator(proto).run(None, {"X": x})[0],
                                           rtol=1e-5, atol=1e-6)
        assert imported.lowerings == lowerings
        per_shape = [str(w.message) for w in said if "once per input shape" in str(w.message)]
        assert len(per_shape) == lowerings - 1
    assert "whole factor" in per_shape[0]
    family = opweave.from_onnx(model([1, 1, 2, 2]))._family()
    (up,) = [n for n in family.graph.nodes if n.op == "upsample_bilinear2d"]
    assert [str(d) for d in up.attrs["size"]] == ["2*h", "2*w"]


def _conv_transpose(x_shape, w, bias=True, **attrs) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(w, "W")]
    inputs = ["X", "W"]
    if bias:
        inits.append(numpy_helper.from_array(RNG.standard_normal(w.shape[1] * attrs.get(
            "group", 1)).astype(np.float32), "B"))
        inputs.append("B")
    return _model([helper.make_node("ConvTranspose", inputs, ["Y"], **attrs)], x_shape, inits)


W = RNG.standard_normal((3, 2, 3, 3)).astype(np.float32)


@pytest.mark.parametrize("attrs, torch_form", [
    (dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0]), True),
    (dict(strides=[2, 3], dilations=[1, 2]), True),
    (dict(strides=[2, 2], pads=[0, 1, 2, 0]), False),  # unequal padding
    (dict(strides=[2, 2], output_shape=[12, 14]), True),  # a row past the kernels' reach
    (dict(strides=[2, 2], auto_pad="SAME_UPPER"), False),
    (dict(strides=[3, 2], auto_pad="SAME_LOWER", output_padding=[1, 1]), True),
])
def test_conv_transpose_pads_as_onnx_says(attrs, torch_form):
    ops = _check(_conv_transpose(X.shape, W, **attrs), X, atol=1e-4)
    assert ops.count("conv_transpose") == 1
    assert (ops == ["conv_transpose"]) == torch_form


def test_grouped_conv_transpose_without_bias():
    """Against torch: the reference evaluator cannot reshape grouped weights."""
    w = RNG.standard_normal((4, 3, 2, 2)).astype(np.float32)
    x = RNG.standard_normal((1, 4, 5, 5)).astype(np.float32)
    imported = opweave.from_onnx(_conv_transpose(x.shape, w, bias=False, group=2,
                                                 strides=[2, 2], pads=[1, 0, 0, 1]))
    expected = torch.nn.functional.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(w),
                                                    stride=2, groups=2)[:, :, 1:, :-1]
    np.testing.assert_allclose(imported(x)[0], expected.numpy(), rtol=1e-5, atol=1e-5)
    assert imported(x)[0].shape == (1, 6, 9, 9)


def _agree_with_onnx_runtime(graph: Graph, x: torch.Tensor) -> None:
    expected = Executor(graph)(x)[0]
    proto = opweave.to_onnx(graph)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, attrs", [
    ("upsample_nearest2d", {"size": [10, 18], "scales_h": 2.0, "scales_w": 3.0}),
    ("upsample_nearest2d", {"size": [7, 4]}),
    ("upsample_bilinear2d", {"size": [9, 9], "scales_h": 1.9, "scales_w": 1.5}),
    ("upsample_bilinear2d", {"size": [9, 9], "scales_h": 1.8, "scales_w": 1.5}),
    ("upsample_bilinear2d", {"size": [8, 11], "align_corners": True}),
])
def test_upsampling_exports_as_resize(op, attrs):
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3, 5, 6), torch.float32))
    g.outputs = [g.add1(op, [x], attrs)]
    _agree_with_onnx_runtime(g, torch.from_numpy(X))


def test_conv_transpose_exports():
    g = Graph("g")
    x = g.add_input("x", TensorType((2, 3, 5, 6), torch.float32))
    w = g.add_constant("w", torch.from_numpy(W))
    g.outputs = [g.add1("conv_transpose", [x, w], {"stride": [2, 2], "padding": [1, 0],
                                                   "output_padding": [1, 1],
                                                   "dilation": [1, 1], "groups": 1})]
    _agree_with_onnx_runtime(g, torch.from_numpy(X))
