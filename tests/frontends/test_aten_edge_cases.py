"""ATen lowerings on edge shapes, through `opweave.compile`, against eager."""
from __future__ import annotations

import warnings

import pytest
import torch

import opweave
from opweave.frontends.program import OpweaveFallbackWarning


class _SoftmaxOfScalar(torch.nn.Module):
    def __init__(self, fn, dim):
        super().__init__()
        self.fn, self.dim = fn, dim

    def forward(self, x):
        return self.fn(x * 2, self.dim) + 1


@pytest.mark.parametrize("fn", [torch.softmax, torch.log_softmax])
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax_of_a_0d_tensor(fn, dim):
    """Used to crash compilation with ZeroDivisionError (dim % rank, rank 0)."""
    model = _SoftmaxOfScalar(fn, dim)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (torch.tensor(3.0),))
    for value in (3.0, -7.5, float("inf"), float("nan")):
        x = torch.tensor(value)
        got = compiled(x)
        assert got.shape == ()
        torch.testing.assert_close(got, model(x), equal_nan=True)


class _Pick(torch.nn.Module):
    def forward(self, x, idx):
        return x[idx] * 2


def test_negative_indices_count_from_the_end():
    """x[idx] accepts negative indices; index_select does not (found by opweave fuzz in
    the gradient of an index_put, which indexes the incoming gradient)."""
    x, idx = torch.randn(4, 2, 3), torch.tensor([0, -4, 3, -1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(_Pick(), (x, idx))
    torch.testing.assert_close(compiled(x, idx), _Pick()(x, idx))
    other = torch.tensor([-2, 1, -3, 2])
    torch.testing.assert_close(compiled(x, other), _Pick()(x, other))


class _Scatter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(4, 2, 3))

    def forward(self, idx, v):
        return self.x.index_put((idx,), v, accumulate=True).square().sum()


def test_the_gradient_of_an_index_put_with_negative_indices():
    model, idx, v = _Scatter(), torch.tensor([0, -4]), torch.tensor(2.24)
    step = opweave.compile(model, (idx, v), train=True)
    step(idx, v).backward()
    got = model.x.grad.clone()
    model.x.grad = None
    model(idx, v).backward()
    torch.testing.assert_close(got, model.x.grad)

class _Split(torch.nn.Module):
    def __init__(self, sizes, dim):
        super().__init__()
        self.sizes, self.dim = sizes, dim

    def forward(self, x):
        parts = torch.split(x * 2, self.sizes, dim=self.dim)
        return tuple(p + i for i, p in enumerate(parts))


@pytest.mark.parametrize("shape, sizes, dim", [((3, 12), [4, 4, 4], -1), ((3, 5), [2, 1], 0)])
def test_split_with_sizes_runs_in_opweave(shape, sizes, dim):
    """GPT-2 splits its fused QKV projection so; it used to run in eager."""
    model, x = _Split(sizes, dim), torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x,))
    for got, want in zip(compiled(x), model(x), strict=True):
        torch.testing.assert_close(got, want)
