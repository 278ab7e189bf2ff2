"""Ops opweave lacks run in eager, the rest in opweave, with one clear warning."""
from __future__ import annotations

import warnings

import pytest
import torch

import opweave
from opweave.frontends.program import OpweaveFallbackWarning


class WithCumprod(torch.nn.Module):
    """cumprod has no IR op: it must fall back, between two supported regions."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.linear(x))
        z = torch.cumprod(y, dim=1) + torch.cumprod(y * 2, dim=1)
        return torch.tanh(z) @ self.linear.weight


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, OpweaveFallbackWarning)]


def test_opweave_compile_splits_around_unsupported_op_and_warns_once():
    model, x = WithCumprod().eval(), torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = opweave.compile(model, (x,))
        first = compiled(x)
        compiled(x)
        opweave.compile(model, (x,))  # same model again: no second warning
    torch.testing.assert_close(first, model(x))
    found = _fallback_warnings(record)
    assert len(found) == 1
    assert "aten.cumprod.default x2 (no lowering)" in str(found[0].message)
    cov = compiled.coverage
    assert cov.fallback == {"aten.cumprod.default": 2}
    assert 0 < cov.share < 1
    assert cov.segments == 2  # before and after the eager cumprods


class WithCasts(torch.nn.Module):
    """`.to(dtype)` exports as `_assert_tensor_metadata` (no outputs) before `_to_copy`."""

    def forward(self, x):
        return x.to(torch.float64) * 2, x.to(torch.int64, copy=True) + 1, x.double().sum()


def test_dtype_conversions_compile_without_fallback():
    model, x = WithCasts(), torch.randn(3, 4) * 4
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = opweave.compile(model, (x,))
    assert not _fallback_warnings(record)
    assert compiled.coverage.fallback == {} and compiled.coverage.segments == 1
    for got, expected in zip(compiled(x), model(x)):
        torch.testing.assert_close(got, expected)


def test_cat_of_only_empty_vectors_compiles_without_fallback():
    """Found by `opweave fuzz`: dropping the legacy 1-d empties left nothing to index."""
    class Cat(torch.nn.Module):
        def forward(self, x, y):
            return torch.cat([x]) + 1, torch.cat([x, x]), torch.cat([x, y])

    x, y = torch.empty(0, dtype=torch.int64), torch.arange(3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = opweave.compile(Cat(), (x, y))
    assert not _fallback_warnings(record)
    for got, expected in zip(compiled(x, y), Cat()(x, y)):
        torch.testing.assert_close(got, expected)


def test_torch_compile_backend_falls_back_too():
    model, x = WithCumprod(), torch.randn(4, 8, requires_grad=True)
    compiled = torch.compile(model, backend="opweave")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out = compiled(x)
        out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(grad, x.grad)


def test_a_graph_torch_compile_hands_over_that_cannot_be_compiled_runs_in_eager(monkeypatch):
    """A failure while compiling a graph Dynamo handed over (torch 2.13's meta function of
    upsample_nearest2d raises TypeError on an empty batch in AOTAutograd's trace, found by
    `opweave fuzz`; here the compile is made to fail) leaves the graph to eager, with one
    warning, not an error in the user's program."""
    from opweave.frontends import torch_dynamo

    def fail(gm, example_inputs, **_):
        raise TypeError("cond must be a bool, but got <class 'int'>")
    monkeypatch.setattr(torch_dynamo, "_compile_inference_graph", fail)
    monkeypatch.setattr(torch_dynamo, "_compile_aten_graph", fail)
    torch._dynamo.reset()
    model, x = WithCumprod(), torch.randn(4, 8)
    compiled = torch.compile(model, backend="opweave")
    with pytest.warns(OpweaveFallbackWarning, match="could not be compiled .*TypeError: cond"):
        with torch.no_grad():
            y = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(y, model(x))
    torch._dynamo.reset()


def test_uncapturable_model_runs_in_eager_with_a_warning():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: neither capture can take it
                return x * 2
            return x - 1

    model, x = DataDependent(), torch.ones(3)
    with pytest.warns(OpweaveFallbackWarning, match="could not capture DataDependent"):
        compiled = opweave.compile(model, (x,))
    assert compiled.capture == "eager"
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(-x), model(-x))


def test_explain_reports_coverage_fallbacks_and_graph_breaks():
    report = opweave.explain(WithCumprod().eval(), (torch.randn(4, 8),))
    assert report.coverage.fallback == {"aten.cumprod.default": 2}
    assert report.graph_breaks == 0
    assert report.ir_ops["matmul"] == 2
    text = str(report)
    assert "aten.cumprod.default x2" in text and "graph breaks under torch.compile: 0" in text


class _ConvGroupNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3)

    def forward(self, x):
        return torch.nn.functional.group_norm(self.conv(x) * 2, 2) + 1


def test_an_eager_step_gets_contiguous_inputs_when_a_segment_returns_a_view(monkeypatch):
    """A library form may return its output as a transposed view; native_group_norm (in
    eager) then raised 'Expected X.is_contiguous' (zoo wav2vec2 under torch.compile, when
    measurement chose such a form). Group norm lowers now: this test takes its lowering
    away to keep the kernel that checks."""
    import opweave
    from opweave.frontends.lowering import TABLE
    from opweave.frontends.program import _Segment

    monkeypatch.delitem(TABLE, torch.ops.aten.native_group_norm.default)

    model, x = _ConvGroupNorm().eval(), torch.randn(1, 4, 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = opweave.compile(model, (x,))
    assert "aten.native_group_norm.default" in compiled.coverage.fallback
    segment = next(s for s in compiled.program.steps if isinstance(s, _Segment))
    produce = segment.executor

    def as_views(*args):  # the same values, laid out column-major
        return [t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t
                for t in produce(*args)]

    segment.executor = as_views
    torch.testing.assert_close(compiled(x), model(x))
