"""The five benchmark models (small variants) lowered for the GPU: every fused group a
Triton kernel, every library call a torch op, run here through Triton's interpreter (on
the GPU when there is one) against the graph's reference ops."""
from __future__ import annotations

import pytest
import torch

from opweave.codegen import lower
from opweave.runtime import Executor

from ..conftest import MODEL_NAMES, compiled_small, small_model
from .triton_env import needs_triton, no_tf32, triton_device  # noqa: F401 (a fixture)


@needs_triton
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_graphs_lowered_for_triton_match_the_reference(name, no_tf32):
    compiled = compiled_small(name)
    graphs = compiled.graphs
    assert graphs
    device = triton_device()
    kernels = 0
    for graph in graphs:
        lowered = lower(graph, "ilp", measure=False, target="triton")
        kernels += lowered.kernel_counts().get("triton", 0)
        inputs = [_example(v) for v in graph.inputs]
        got = Executor(graph, steps=lowered.steps, device=device)(*[x.to(device) for x in inputs])
        want = Executor(graph)(*inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.cpu(), b, atol=1e-4, rtol=1e-4)
    if not name.startswith("gcn"):  # GCN's fusible ops are single (a ReLU, a log-softmax)
        assert kernels > 0, "no group became a Triton kernel"


def _example(value) -> torch.Tensor:
    t = value.type
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    return torch.zeros(t.shape, dtype=t.dtype)  # indices: 0 is valid for every table
