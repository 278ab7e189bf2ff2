"""The benchmark models (small variants) through both frontends, against eager."""
from __future__ import annotations

import copy

import pytest
import torch

from opweave.frontends import torch_dynamo

from ..conftest import MODEL_NAMES, compiled_small, small_model

ATOL = 1e-4


def _flat(out):
    return torch.utils._pytree.tree_flatten(out)[0]


def _assert_same(got, expected):
    got, expected = _flat(got), _flat(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_opweave_compile_matches_eager_with_full_coverage(name):
    bench = small_model(name)
    compiled = compiled_small(name)  # fails on any fallback warning
    assert compiled.capture == "export"
    assert compiled.coverage.share == 1.0 and not compiled.coverage.fallback
    assert compiled.coverage.segments == 1
    with torch.no_grad():
        _assert_same(compiled(*bench.inputs), bench.module(*bench.inputs))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_compile_backend_matches_eager_in_inference(name):
    bench = small_model(name)
    before = torch_dynamo.compiled_graphs.mark()
    module = torch.compile(bench.module.eval(), backend="opweave")  # by entry-point name
    with torch.no_grad():
        _assert_same(module(*bench.inputs), bench.module(*bench.inputs))
    programs = torch_dynamo.compiled_graphs.since(before)
    assert programs, "the opweave backend was not called"
    assert sum(sum(p.coverage.supported.values()) for p in programs) > 0


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_torch_compile_backend_matches_eager_gradients(name):
    """Forward and backward graphs both go through opweave; eval mode keeps it deterministic."""
    bench = small_model(name)
    loss_module = bench.loss_module.eval()
    params = [p for p in loss_module.parameters() if p.requires_grad]

    def grads(module):
        loss = module(*bench.inputs, bench.targets)
        return [loss.detach()] + list(torch.autograd.grad(loss, params, allow_unused=True))

    expected = grads(loss_module)
    before = torch_dynamo.compiled_graphs.mark()
    got = grads(torch.compile(loss_module, backend="opweave"))
    programs = torch_dynamo.compiled_graphs.since(before)
    assert len(programs) >= 2, "expected forward and backward graphs"
    fallbacks = [dict(p.coverage.fallback) for p in programs if p.coverage.fallback]
    assert not fallbacks, f"training graphs fell back to eager: {fallbacks}"
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e, atol=ATOL, rtol=1e-4)


def test_training_mode_step_runs_and_learns():
    """Dropout and batch statistics in train mode: random, so check behaviour, not bits."""
    bench = small_model("xmlcnn")
    # a copy: the optimizer must not change the cached model other tests compile
    module = copy.deepcopy(bench.loss_module).train()
    compiled = torch.compile(module, backend="opweave")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = compiled(*bench.inputs, bench.targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    module.eval()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_sparse_gcn_and_adaptive_pooling_are_native_ir_ops():
    (gcn,) = compiled_small("gcn").graphs
    assert gcn.op_counts().get("sparse_mm") == 2 and "matmul" in gcn.op_counts()
    (xml,) = compiled_small("xmlcnn").graphs
    assert xml.op_counts().get("adaptive_max_pool2d") == 3
