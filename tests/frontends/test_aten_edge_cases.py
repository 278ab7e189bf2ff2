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
