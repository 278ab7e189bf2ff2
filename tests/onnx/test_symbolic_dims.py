"""ONNX `dim_param`s: a model with a symbolic batch is lowered to the IR once, with the
batch as a symbol, and specialized per batch size; one whose lowering needs concrete sizes
is lowered per shape, with one warning."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import opweave
from opweave.notices import OpweaveFallbackWarning

from .helpers import WEIGHT, mlp, mlp_reference


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
    # X / Size(X): a size over the symbolic batch used as data, not as a shape
    nodes = [helper.make_node("Size", ["X"], ["N"], name="size"),
             helper.make_node("Cast", ["N"], ["F"], name="cast", to=TensorProto.FLOAT),
             helper.make_node("Div", ["X", "F"], ["X2"], name="div"),
             helper.make_node("MatMul", ["X2", "W"], ["H"], name="matmul"),
             helper.make_node("Relu", ["H"], ["Y"], name="relu")]
    model = opweave.from_onnx(mlp(nodes=nodes).SerializeToString())
    with pytest.warns(OpweaveFallbackWarning, match="once per input shape") as record:
        for batch in (2, 3, 2):
            x = np.ones((batch, 4), np.float32)
            np.testing.assert_allclose(model(x)[0], mlp_reference(x / x.size), rtol=1e-5)
    assert len([w for w in record if "once per input shape" in str(w.message)]) == 1
    assert model.lowerings == 2


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def test_shape_arithmetic_over_symbols_is_lowered_once():
    """Shape -> Gather -> Concat -> Reshape (with a -1), Mul and Range over the symbolic
    batch: computed at import time as sizes over the symbol, so the model is lowered once."""
    nodes = [helper.make_node("Shape", ["X"], ["S"]),
             helper.make_node("Gather", ["S", "zero"], ["B"], axis=0),            # [batch]
             helper.make_node("Concat", ["B", "two_two"], ["T"], axis=0),         # [batch, 2, 2]
             helper.make_node("Reshape", ["X", "T"], ["X3"]),
             helper.make_node("Mul", ["B", "two"], ["B2"]),                       # [2 * batch]
             helper.make_node("Concat", ["B2", "two"], ["T2"], axis=0),           # [2 * batch, 2]
             helper.make_node("Reshape", ["X3", "T2"], ["X2"]),
             helper.make_node("Concat", ["B", "minus_one"], ["T3"], axis=0),      # [batch, -1]
             helper.make_node("Reshape", ["X2", "T3"], ["X4"]),
             helper.make_node("MatMul", ["X4", "W"], ["H"]),
             helper.make_node("Relu", ["H"], ["R"]),
             helper.make_node("Squeeze", ["B"], ["n"]),
             helper.make_node("Range", ["zero_scalar", "n", "one_scalar"], ["P"]),  # 0..batch-1
             helper.make_node("Cast", ["P"], ["PF"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["PF", "one"], ["PC"]),
             helper.make_node("Add", ["R", "PC"], ["Y"])]
    inits = [numpy_helper.from_array(WEIGHT, "W"), _ints("zero", [0]), _ints("two_two", [2, 2]),
             _ints("two", [2]), _ints("minus_one", [-1]), _ints("one", [1]),
             numpy_helper.from_array(np.array(0, np.int64), "zero_scalar"),
             numpy_helper.from_array(np.array(1, np.int64), "one_scalar")]
    model = opweave.from_onnx(mlp(nodes=nodes, initializers=inits).SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        for batch in (2, 5, 1, 2):
            x = np.random.default_rng(batch).standard_normal((batch, 4), dtype=np.float32)
            want = mlp_reference(x) + np.arange(batch, dtype=np.float32)[:, None]
            np.testing.assert_allclose(model(x)[0], want, rtol=1e-5, atol=1e-6)
    assert model.lowerings == 1
    assert model._family().compiles == 3
    assert model._family().per_binding is None  # the graph passes ran once, symbolically


def test_exported_bert_with_dynamic_batch_and_sequence_is_lowered_once(tmp_path):
    """torch.onnx.export writes BERT's attention reshapes as Shape -> Concat -> Reshape
    over the dynamic dims: they become symbolic attributes, one lowering for all sizes."""
    import torch
    from torch.export import Dim

    from opweave.models import build

    torch.manual_seed(0)
    module = build("bert-base", small=True).module.eval()
    ids = torch.randint(0, 1000, (2, 8))
    path = tmp_path / "bert.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (ids,), dynamo=True, optimize=True, verbose=False,
                          dynamic_shapes=({0: Dim("batch", max=16), 1: Dim("seq", max=64)},)
                          ).save(str(path))
    model = opweave.from_onnx(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        for batch, seq in [(2, 8), (3, 16), (1, 64), (2, 8)]:
            ids = torch.randint(0, 1000, (batch, seq))
            got = model(ids.numpy())
            with torch.no_grad():
                want = module(ids)
            for g, w in zip(got, (want[0], want[1])):
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)
    assert model.lowerings == 1
    assert model._family().compiles == 3
    assert model._family().per_binding is None  # the graph passes ran once, symbolically


def test_integer_division_of_sizes_truncates_as_onnx_does():
    import torch

    from opweave.ir import symbols
    from opweave.onnx.symbolic_folds import fold_symbolic

    s0 = symbols.symbol("s0")
    sizes = np.array([s0 * 6, 7, -7], dtype=object)
    got = fold_symbolic("div", [sizes, np.array([3, 2, 2], dtype=object)], {"rounding": "trunc"})
    assert list(got) == [2 * s0, 3, -3]
    assert fold_symbolic("div", [np.array([s0], dtype=object), np.array([-2], dtype=object)],
                         {"rounding": "trunc"}) is None
    assert fold_symbolic("cast", [sizes], {"dtype": torch.float32}) is None


def test_a_declared_size_of_zero_is_a_size_not_a_symbol():
    """A graph over an empty input reshaped to a size of 0 (`allowzero`) lowers for the
    shape it declares, with no word about symbols; the declared 0 still binds another
    size, for exporters that wrote 0 for an unknown dim."""
    from opweave.ir import parse_graph

    graph = parse_graph("""graph @empty(%x: f32[5,4,0], %y: f32[2,0]) {
      %r: f32[5,0] = reshape(%x) {shape=[5, 0]}
      %s: f32[2,0] = neg(%y)
      return %r, %s
    }""", {})
    model = opweave.from_onnx(opweave.to_onnx(graph))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        r, s = model(np.zeros((5, 4, 0), np.float32), np.zeros((2, 0), np.float32))
    assert r.shape == (5, 0) and s.shape == (2, 0)
    assert model._family() is None and model.lowerings == 1
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    _, s = model(np.zeros((5, 4, 0), np.float32), y)
    np.testing.assert_array_equal(s, -y)
