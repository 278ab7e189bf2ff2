"""The benchmark models (small variants) on CUDA tensors: Triton kernels, torch's CUDA
libraries and CUDA graph replay, against eager on the same GPU. Skipped without a GPU;
the kernels themselves are also checked without one (tests/codegen, Triton's
interpreter)."""
from __future__ import annotations

import warnings

import pytest
import torch

import opweave
from opweave.notices import OpweaveFallbackWarning
from opweave.runtime.cuda_graphs import CudaGraphed

from ..codegen.triton_env import no_tf32  # noqa: F401 (a fixture)
from ..conftest import MODEL_NAMES, small_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_runs_on_cuda_and_replays_a_cuda_graph(name, no_tf32):
    bench = small_model(name)
    module = bench.module.eval().cuda()
    inputs = tuple(t.cuda() for t in bench.inputs)
    with torch.no_grad():
        want = module(*inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OpweaveFallbackWarning)
            compiled = opweave.compile(module, inputs, name=name)
        for _ in range(4):  # the third call captures, the fourth replays
            got = compiled(*inputs)
    leaves = [t for t in torch.utils._pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    wants = [t for t in torch.utils._pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
    for a, b in zip(leaves, wants):
        assert a.is_cuda
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    executors = [g.executor for g in compiled.program.compiled_graphs]
    assert executors and all(isinstance(e, CudaGraphed) for e in executors)
    assert all(e.cuda_graph is not None for e in executors), [e.why_not for e in executors]
