"""The Triton GEMM template with the epilogue inside, against the graph's reference ops
(forced on: outside a GPU the split form is what runs), and the choice between it and
cuBLAS plus an epilogue kernel."""
from __future__ import annotations

import pytest
import torch

from opweave.codegen import lower
from opweave.codegen.triton.gemm import GemmChoice
from opweave.ir import Graph, TensorType
from opweave.runtime import Executor

from ..partition.graphs import linear, mlp_block
from .triton_env import needs_triton, no_tf32, triton_device  # noqa: F401 (a fixture)

pytestmark = needs_triton


def _run(g: Graph, force: str, *inputs):
    lowered = lower(g, "ilp", measure=False, target="triton")
    choices = [s.fn for s in lowered.steps if isinstance(s.fn, GemmChoice)]
    for choice in choices:
        choice.chosen = force
    device = triton_device()
    got = Executor(g, steps=lowered.steps, device=device)(*[x.to(device) for x in inputs])
    return [t.cpu() for t in got], lowered


@pytest.mark.parametrize("force", ["template", "split"])
def test_linear_layers_with_their_epilogues_match_the_reference(force, no_tf32):
    """BERT's feed-forward block: bias and GELU after the first product; bias, a reshape
    and the residual add after the second (the weights as transposed views of [N, K])."""
    g = mlp_block(rows=20, width=48, hidden=80)
    x = torch.randn(1, 20, 48)
    got, lowered = _run(g, force, x)
    assert [s.name for s in lowered.steps if s.name.endswith("(gemm)")] == [
        "matmul+add+gelu (gemm)", "matmul+add+reshape+add (gemm)"]
    for a, b in zip(got, Executor(g)(x)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_split_epilogue_is_one_kernel_across_a_reshape_that_keeps_the_rows(no_tf32):
    """cuBLAS, then bias, reshape and residual add as one Triton kernel (the reshape only
    regroups the rows: the same tile), with a residual read past the reshape."""
    g = mlp_block(rows=12, width=32, hidden=48)
    lowered = lower(g, "ilp", measure=False, target="triton")
    (choice,) = [s.fn for s in lowered.steps if s.name == "matmul+add+reshape+add (gemm)"]
    assert [st.kind for st in choice.split.steps] == ["op", "triton"]
    assert [n.op for n in choice.split.steps[1].nodes] == ["add", "reshape", "add"]
    x = torch.randn(1, 12, 32)
    got, _ = _run(g, "split", x)
    torch.testing.assert_close(got[0], Executor(g)(x)[0], atol=1e-4, rtol=1e-4)


def test_a_weight_stored_as_it_is_read_with_an_activation(no_tf32):
    """A [K, N] weight (strides (N, 1)), not the transposed view of an [N, K] one; sizes
    that no tile divides."""
    g = Graph("lin_relu")
    x = g.add_input("x", TensorType((33, 17), torch.float32))
    y = g.add1("matmul", [x, g.add_constant("w", torch.randn(17, 40))])
    g.outputs = [g.add1("relu", [y])]
    data = torch.randn(33, 17)
    got, lowered = _run(g, "template", data)
    assert [s.kind for s in lowered.steps] == ["triton"]
    torch.testing.assert_close(got[0], Executor(g)(data)[0], atol=1e-4, rtol=1e-4)


def test_the_split_form_runs_outside_a_gpu():
    g = Graph("lin")
    x = g.add_input("x", TensorType((4, 32), torch.float32))
    g.outputs = [g.add1("gelu", [linear(g, x, 32, 16, "fc")])]
    if torch.cuda.is_available():
        pytest.skip("on a GPU the choice is measured")
    lowered = lower(g, "ilp", measure=False, target="triton")
    (choice,) = [s.fn for s in lowered.steps if isinstance(s.fn, GemmChoice)]
    Executor(g, steps=lowered.steps)(torch.randn(4, 32))
    assert choice.chosen == "split"


def test_a_kernel_that_fails_runs_its_ops_as_torch_ops():
    """A kernel that fails to compile or launch (ptxas, out of resources) costs its group
    the fusion, with one warning, not the user's call."""
    import warnings

    from opweave.codegen.triton.kernel import KernelWarning, TritonKernel

    g = Graph("fails")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.outputs = [g.add1("relu", [g.add1("exp", [x])])]
    lowered = lower(g, "ilp", measure=False, target="triton")
    (step,) = lowered.steps
    assert isinstance(step.fn, TritonKernel)

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("out of resources: shared memory")
            return launch
    step.fn.fn = Broken()
    run = Executor(g, steps=lowered.steps)
    data = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(run(data)[0], torch.relu(torch.exp(data)))
    assert len([w for w in caught if issubclass(w.category, KernelWarning)]) == 1
    assert "out of resources" in step.fn.failed


def test_bf16_products_keep_the_split_form():
    """precision="bf16" computes products in bf16: the float32 template is not offered."""
    lowered = lower(mlp_block(rows=8, width=16, hidden=32), "ilp", measure=False,
                    precision="bf16", target="triton")
    assert not any(isinstance(s.fn, GemmChoice) for s in lowered.steps)
    assert any("[bf16]" in s.name for s in lowered.steps)


def test_the_profiler_names_every_kind_of_step_the_gpu_lowering_makes():
    from opweave.profiling.record import KINDS

    lowered = lower(mlp_block(rows=8, width=16, hidden=32), "ilp", measure=False,
                    target="triton")
    assert {s.kind for s in lowered.steps} == {"triton", "op"}
    assert all(s.kind in KINDS for s in lowered.steps)
