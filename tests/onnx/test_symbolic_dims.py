"""ONNX `dim_param`s: a model with a symbolic batch is lowered to the IR once, with the
batch as a symbol, and specialized per batch size; one whose lowering needs concrete sizes
is lowered per shape, with one warning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import helper

import opweave
from opweave.notices import OpweaveFallbackWarning

from .helpers import mlp, mlp_reference


def test_symbolic_batch_is_lowered_once():
    model = opweave.from_onnx(mlp().SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        for batch in (2, 5, 2, 7):
            x = np.random.default_rng(batch).standard_normal((batch, 4), dtype=np.float32)
            (y,) = model(x)
            np.testing.assert_allclose(y, mlp_reference(x), rtol=1e-5, atol=1e-6)
    assert model.lowerings == 1
    assert model._family().compiles == 3  # batches 2, 5, 7


def test_unnamed_dims_get_symbols_of_their_own():
    model = opweave.from_onnx(mlp(batch=None).SerializeToString())
    for batch in (3, 4):
        x = np.ones((batch, 4), np.float32)
        np.testing.assert_allclose(model(x)[0], mlp_reference(x), rtol=1e-5)
    assert model.lowerings == 1


def test_a_model_needing_concrete_sizes_is_lowered_per_shape_with_one_warning():
    # Reshape(X, Shape(X)): the shape is a tensor computed from the symbolic batch
    nodes = [helper.make_node("Shape", ["X"], ["S"], name="shape"),
             helper.make_node("Reshape", ["X", "S"], ["X2"], name="reshape"),
             helper.make_node("MatMul", ["X2", "W"], ["H"], name="matmul"),
             helper.make_node("Relu", ["H"], ["Y"], name="relu")]
    model = opweave.from_onnx(mlp(nodes=nodes).SerializeToString())
    with pytest.warns(OpweaveFallbackWarning, match="once per input shape") as record:
        for batch in (2, 3, 2):
            x = np.ones((batch, 4), np.float32)
            np.testing.assert_allclose(model(x)[0], mlp_reference(x), rtol=1e-5)
    assert len([w for w in record if "once per input shape" in str(w.message)]) == 1
    assert model.lowerings == 2
