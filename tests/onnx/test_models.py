"""The benchmark models through torch.onnx.export -> opweave -> ONNX again.

Small variants always; the full-size models too with OPWEAVE_FULL_MODELS=1 (minutes).
"""
from __future__ import annotations

import functools
import io
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import opweave
from opweave.bench.backends import export_onnx

from opweave import models

from ..conftest import MODEL_NAMES, small_model

ATOL = 1e-4
# Full-size models: the exporter folds batch norm into the convolutions, which rounds
# differently; 1e-3 is the tolerance `opweave demo` holds full models to.
FULL_ATOL = 1e-3
SIZES = ["small"] + (["full"] if os.environ.get("OPWEAVE_FULL_MODELS") == "1" else [])
CASES = [(name, size) for size in SIZES for name in MODEL_NAMES]


@functools.lru_cache(maxsize=None)
def model(name: str, size: str):
    return small_model(name) if size == "small" else models.build(name)


@functools.lru_cache(maxsize=None)
def exported(name: str, size: str, tmp_dir: str) -> str:
    bench = model(name, size)
    module = (bench.export_module or bench.module).eval()
    path = f"{tmp_dir}/{name}-{size}.onnx"
    export_onnx(module, bench.inputs, path)
    return path


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("onnx"))


def _eager(bench):
    with torch.no_grad():
        out = bench.module.eval()(*bench.inputs)
    return [t.numpy() for t in torch.utils._pytree.tree_flatten(out)[0]]


@pytest.mark.parametrize("name,size", CASES)
def test_exported_model_imports_and_matches_eager(name, size, onnx_dir):
    bench = model(name, size)
    imported = opweave.from_onnx(exported(name, size, onnx_dir))
    got = imported(*[x.numpy() for x in bench.inputs])
    expected = _eager(bench)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, atol=ATOL if size == "small" else FULL_ATOL, rtol=1e-4)


@pytest.mark.parametrize("name,size", CASES)
def test_round_trip_through_onnx_export_runs_in_onnxruntime(name, size, onnx_dir):
    bench = model(name, size)
    imported = opweave.from_onnx(exported(name, size, onnx_dir))
    proto = opweave.to_onnx(imported)  # onnx.checker with full shape inference inside
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), bench.inputs)}
    atol = ATOL if size == "small" else FULL_ATOL
    for g, e in zip(session.run(None, feed), _eager(bench)):
        np.testing.assert_allclose(g, e, atol=atol, rtol=1e-4)
    # and opweave reads its own export back
    again = opweave.from_onnx(proto)(*[x.numpy() for x in bench.inputs])
    for g, e in zip(again, _eager(bench)):
        np.testing.assert_allclose(g, e, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", ["xmlcnn", "gcn"])
def test_torch_path_graph_exports_with_its_own_ops(name):
    """Graphs from the torch frontend carry IR ops ONNX lacks (adaptive max pooling, sparse
    matmul); the exporter writes them as gathers and scatter-adds, which ORT runs."""
    bench = small_model(name)
    compiled = opweave.compile(bench.module.eval(), bench.inputs)
    ops = compiled.graphs[0].op_counts()
    assert ("adaptive_max_pool2d" in ops) if name == "xmlcnn" else ("sparse_mm" in ops)
    buffer = io.BytesIO(opweave.to_onnx(compiled).SerializeToString())
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), bench.inputs)}
    for g, e in zip(session.run(None, feed), _eager(bench)):
        np.testing.assert_allclose(g, e, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", ["zoo-mobilenet-v2", "zoo-inception3", "zoo-densenet",
                                  "zoo-efficientnet", "zoo-unet", "zoo-segformer-seg"])
def test_zoo_cnns_with_padding_pooling_and_upsampling_import(name, onnx_dir):
    """Networks whose export has a Pad, a convolution with unequal pads (TensorFlow's
    SAME padding), an AveragePool, a ConvTranspose or a Resize, each refused before; then
    back out to ONNX Runtime."""
    bench = model(name, "small")
    imported = opweave.from_onnx(exported(name, "small", onnx_dir))
    expected = _eager(bench)
    for g, e in zip(imported(*[x.numpy() for x in bench.inputs]), expected):
        np.testing.assert_allclose(g, e, atol=ATOL, rtol=1e-4)
    proto = opweave.to_onnx(imported)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: x.numpy() for i, x in zip(session.get_inputs(), bench.inputs)}
    for g, e in zip(session.run(None, feed), expected):
        np.testing.assert_allclose(g, e, atol=ATOL, rtol=1e-4)
