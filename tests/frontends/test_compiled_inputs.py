"""Bad arguments to a compiled model are clear errors naming the input, never a crash in
a generated kernel or a silent mis-binding."""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import opweave
from opweave.runtime import InputError


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4)).eval()


@pytest.fixture(scope="module")
def compiled():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return opweave.compile(_mlp(), (torch.randn(4, 8),), name="mlp", fusion="ilp")


@pytest.mark.parametrize("args, error, message", [
    ((torch.randn(5, 8),), InputError,
     r"mlp was compiled for tensor argument 0 of shape \[4, 8\], float32 on cpu, "
     r"got shape \[5, 8\], float32 on cpu"),
    ((torch.randn(4, 8, dtype=torch.float64),), InputError, r"got shape \[4, 8\], float64 on cpu"),
    ((torch.randn(4, 8).to_sparse(),), InputError, r"float32 on cpu \(torch.sparse_coo\)"),
    # what Python and the model itself say, as in eager
    ((), TypeError, r"mlp.forward\(input\): missing a required argument: 'input'"),
    ((torch.randn(4, 8), torch.randn(4, 8)), TypeError, r"too many positional arguments"),
    (([[1.0] * 8] * 4,), TypeError, r"must be Tensor, not list"),
    ((3.0,), TypeError, r"must be Tensor, not float"),
])
def test_bad_arguments_are_clear_errors(compiled, args, error, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a non-tensor argument: could not capture, eager
        with pytest.raises(error, match=message):
            compiled(*args)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), _mlp()(x))  # still works after the error


def test_keyword_arguments_the_model_does_not_take(compiled):
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'y'"):
        compiled(torch.randn(4, 8), y=torch.randn(4, 8))


_META = """
import warnings, torch, opweave
from opweave.runtime import InputError
warnings.simplefilter("ignore")
class M(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 2 + 1).sum(-1)
compiled = opweave.compile(M(), (torch.randn(4, 8),), fusion="ilp")
assert compiled.graphs and compiled.program.steps
try:
    compiled(torch.randn(4, 8, device="meta"))
except InputError as error:
    print(error)
"""


def test_a_tensor_on_another_device_never_reaches_a_kernel():
    """A meta tensor (no memory) used to segfault inside a generated kernel; in a
    subprocess, so that the crash fails this test instead of killing pytest."""
    proc = subprocess.run([sys.executable, "-c", _META], capture_output=True, text=True)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "compiled for tensor argument 0 of shape [4, 8], float32 on cpu, got shape [4, 8], " \
        "float32 on meta" in proc.stdout
