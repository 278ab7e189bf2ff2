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


@pytest.mark.parametrize("args, message", [
    ((torch.randn(5, 8),), r"input 0 \(%\w+\) has shape \[5, 8\] and dtype torch.float32, "
                           r"expected f32\[4,8\]"),
    ((torch.randn(4, 8, dtype=torch.float64),), r"input 0 .* dtype torch.float64, expected f32\[4,8\]"),
    ((), r"mlp was compiled for 1 positional input\(s\), got 0"),
    ((torch.randn(4, 8), torch.randn(4, 8)), r"compiled for 1 positional input\(s\), got 2"),
    (([[1.0] * 8] * 4,), r"input 0 of mlp is a list of 4 item\(s\), expected a single tensor"),
    ((3.0,), r"input 0 \(%\w+\) must be a tensor, got float"),
    ((torch.randn(4, 8).to_sparse(),), r"input 0 \(%\w+\) is a cpu sparse_coo tensor, "
                                       r"expected a CPU strided tensor"),
])
def test_bad_arguments_are_clear_errors(compiled, args, message):
    with pytest.raises(InputError, match=message):
        compiled(*args)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), _mlp()(x))  # still works after the error


def test_keyword_arguments_the_example_did_not_have(compiled):
    with pytest.raises(InputError, match=r"got 1 and keywords \['y'\]"):
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
    assert "input 0 (%" in proc.stdout and "is a meta tensor, expected a CPU strided tensor" \
        in proc.stdout
