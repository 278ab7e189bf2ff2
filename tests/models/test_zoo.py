"""Every zoo model's small variant through both frontends, against eager (float32).

The ops each model runs in eager PyTorch are listed with the reason, so a new fallback
(or a capture that stops working) fails here. Expected fallbacks on the Dynamo path are
a subset of these: it captures no export-only ops.
"""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

import opweave
from opweave import models
from opweave.frontends import torch_dynamo

# name -> the ops that run in eager (Coverage.fallback keys), and why; absent: none
EXPECTED_FALLBACKS: dict[str, set[str]] = {}


@functools.lru_cache(maxsize=None)
def _small(name: str) -> models.BenchmarkModel:
    return models.build(f"zoo-{name}", small=True)


def _assert_close(got, expected):
    got, expected = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        scale = max(1.0, e.abs().max().item()) if e.is_floating_point() and e.numel() else 1.0
        torch.testing.assert_close(g, e, atol=1e-4 * scale, rtol=1e-4)


def _fresh(inputs: tuple) -> tuple:
    """Other inputs of the same shapes (token ids within the example's range), so that a
    program that kept the example's values would fail."""
    gen = torch.Generator().manual_seed(7)
    return tuple(torch.randn(x.shape, generator=gen) if x.is_floating_point() else
                 torch.randint(0, int(x.max()) + 1, x.shape, generator=gen) for x in inputs)


def test_the_zoo_has_at_least_25_architectures_beyond_the_benchmark_set():
    assert len(models.ZOO_SET) >= 25
    assert not set(models.ZOO_SET) & set(models.BENCHMARK_SET)
    assert all(name in models.BUILDERS for name in models.ZOO_SET)


@pytest.mark.parametrize("name", list(models.zoo.ZOO))
def test_opweave_compile_matches_eager(name):
    bench = _small(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are checked below, by op
        compiled = opweave.compile(bench.module, bench.inputs, name=name)
    assert compiled.capture == "export", compiled.capture_error
    assert set(compiled.coverage.fallback) == EXPECTED_FALLBACKS.get(name, set()), \
        compiled.coverage.reasons
    with torch.no_grad():
        for inputs in (bench.inputs, _fresh(bench.inputs)):
            _assert_close(compiled(*inputs), bench.module(*inputs))


@pytest.mark.parametrize("name", list(models.zoo.ZOO))
def test_torch_compile_backend_matches_eager(name):
    bench = _small(name)
    before = torch_dynamo.compiled_graphs.mark()
    module = torch.compile(bench.module, backend="opweave")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for inputs in (bench.inputs, _fresh(bench.inputs)):
            _assert_close(module(*inputs), bench.module(*inputs))
    programs = torch_dynamo.compiled_graphs.since(before)
    assert programs, "the opweave backend was not called"
    fallbacks = {op for p in programs for op in p.coverage.fallback}
    assert fallbacks <= EXPECTED_FALLBACKS.get(name, set()), fallbacks
