"""Products of a few rows with a constant weight on opweave's own kernel (codegen/gemv.py)
against torch, and the form's place among the library forms."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opweave
from opweave import Options
from opweave.codegen import build, gemv, library, precision

pytestmark = pytest.mark.skipif(gemv.kernel() is None, reason="no C++ compiler here")


def _finish(y, residual, unary):
    if residual is not None:
        y = y + residual
    if unary == "relu":
        return y.relu()
    if unary == "tanh":
        return y.tanh()
    if unary == "sigmoid":
        return y.sigmoid()
    if unary == ("clamp", 0.0, 6.0):
        return y.clamp(0.0, 6.0)
    if isinstance(unary, tuple):
        return F.gelu(y, approximate=unary[1])
    return y


@pytest.mark.parametrize("rows, k, n", [(1, 512, 4000), (3, 7, 5), (16, 300, 33), (1, 1, 1)])
@pytest.mark.parametrize("unary", [None, "relu", "tanh", "sigmoid", ("gelu", "none"),
                                   ("gelu", "tanh"), ("clamp", 0.0, 6.0)])
@pytest.mark.parametrize("residual", [False, True])
def test_matches_torch(rows, k, n, unary, residual):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(rows, k), torch.randn(k, n), torch.randn(n)
    other = torch.randn(rows, n) if residual else None
    product = gemv.Gemv(rows, weight, bias, unary, residual=residual)
    want = _finish(x @ weight + bias, other, unary)
    torch.testing.assert_close(product(x, other), want, atol=1e-4, rtol=1e-4)


def test_without_a_bias_and_with_a_non_contiguous_input():
    torch.manual_seed(0)
    x, weight = torch.randn(24, 2).t(), torch.randn(24, 10)   # x: a transposed view
    torch.testing.assert_close(gemv.Gemv(2, weight, None)(x), x @ weight,
                               atol=1e-4, rtol=1e-4)


def test_wrong_sizes_are_refused():
    with pytest.raises(ValueError, match="1 to 16 rows, not 17"):
        gemv.Gemv(17, torch.randn(4, 4), None)
    product = gemv.Gemv(2, torch.randn(4, 3), None)
    with pytest.raises(ValueError, match=r"built for \(2, 4\) float32 got \(3, 4\)"):
        product(torch.randn(3, 4))


def _linear_group(rows: int):
    from opweave.ir import Graph, TensorType
    from opweave.partition.legality import Epilogue

    from ..partition.graphs import linear

    g = Graph("lin")
    x = g.add_input("x", TensorType((rows, 8), torch.float32))
    g.outputs = [linear(g, x, 8, 16, "fc")]
    return g, next(n for n in g.nodes if n.op == "matmul"), Epilogue()


def test_it_is_offered_to_few_row_float32_products_only():
    g, anchor, ep = _linear_group(1)
    assert "cpp-gemv" in library.forms(g, anchor, ep)
    if precision.bf16_supported():  # (elsewhere torch cannot pack a bf16 weight at all)
        # not beside bf16 forms, whose weight is half its bytes
        offered = library.forms(g, anchor, ep, precision="bf16")
        assert "onednn-bf16" in offered and "onednn" in offered
        assert not any(name.startswith("cpp-gemv") for name in offered)
    g, anchor, ep = _linear_group(library.GEMV_ROWS + 1)   # a blocked GEMM is faster there
    assert "cpp-gemv" not in library.forms(g, anchor, ep)


def test_a_graph_compiled_for_many_sizes_is_not_offered_it_and_keeps_its_own_records():
    """Its plans share torch's packs there, where the kernel would keep a copy of each
    weight per plan; its choice among fewer forms must not overwrite a one-size record."""
    from opweave import shared_constants

    g, anchor, ep = _linear_group(1)
    alone = library.signature(g, anchor, ep)
    with shared_constants.sharing(1):
        assert "cpp-gemv" not in library.forms(g, anchor, ep)
        shared = library.signature(g, anchor, ep)
    assert ("without", "cpp-gemv") in shared and ("without", "cpp-gemv") not in alone


class _Residual(nn.Module):
    """Linear + GELU, then a linear layer with a residual add: both epilogues."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 128)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(h) + h


def test_a_batch_one_model_runs_it_and_the_native_plan_replays_it(monkeypatch):
    calls = []
    call = gemv.Gemv.__call__
    monkeypatch.setattr(gemv.Gemv, "__call__",
                        lambda self, *args: calls.append(self.in_shape) or call(self, *args))
    torch.manual_seed(0)
    model = _Residual().eval()
    x = torch.randn(1, 64)
    compiled = opweave.compile(model, (x,), options=Options(
        measure=False, deterministic=True, native="wait", tuning_db=None))
    executor = compiled.program.compiled_graphs[0].executor
    assert [s.kind for s in executor.lowered_steps].count("library") == 2
    compiled(x)
    assert sorted(calls) == [(1, 64), (1, 128)]     # both products ran on the kernel
    for _ in range(3):
        compiled(torch.randn(1, 64))
    assert executor.native.plan is not None, executor.native.describe()
    assert executor.native.counts[1] >= 2       # both products are raw kernel calls
    x = torch.randn(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


def test_without_a_compiler_the_other_forms_remain(monkeypatch):
    def no_compiler(body):
        raise build.BuildError("no compiler (test)")
    monkeypatch.setattr(build, "load", no_compiler)
    gemv.kernel.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="few-row product kernel could not be built"):
            g, anchor, ep = _linear_group(1)
            forms = library.forms(g, anchor, ep)
        assert "cpp-gemv" not in forms and "onednn" in forms
    finally:
        gemv.kernel.cache_clear()
