"""Freed memory kept for the next call: with glibc's thresholds set, a tensor allocated and
freed again on every call stops faulting its pages in; `allocator="system"` leaves the C
library's policy alone; explain says which."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import opweave
from opweave.options import Options
from opweave.runtime import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from opweave.runtime import allocator
    if sys.argv[1] == "keep":
        assert allocator.keep_freed_memory()
    for _ in range(3):
        torch.empty(10 << 20).fill_(1.0)  # 40 MB: above glibc's largest automatic threshold
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(10 << 20).fill_(1.0)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
""")


def _faults_per_call(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not allocator.is_glibc(), reason="the C library is not glibc")
def test_kept_memory_is_not_faulted_in_again_on_every_call():
    assert allocator.keep_freed_memory()  # glibc takes the thresholds
    system, keep = _faults_per_call("system"), _faults_per_call("keep")
    # 40 MB is 10,240 pages of 4 KiB, or 20 where transparent huge pages back it
    assert system >= 15 and keep * 10 <= system, (system, keep)


class Small(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x @ x.T) + 1.0


@pytest.mark.parametrize("mode", ["keep", "system"])
def test_explain_says_whether_freed_memory_is_kept(mode):
    x = torch.randn(8, 8)
    compiled = opweave.compile(Small(), [x], options=Options(allocator=mode))
    (graph,) = compiled.program.compiled_graphs
    kept = "freed memory kept for the next call" in graph.report("lower")
    assert kept == (mode == "keep" and allocator.keep_freed_memory())
    torch.testing.assert_close(compiled(x), Small()(x))


def test_the_allocator_option_is_checked_and_read_from_the_environment():
    assert Options.from_env({"OPWEAVE_ALLOCATOR": "system"}).allocator == "system"
    assert Options.from_env({}).allocator == "keep"
    with pytest.raises(ValueError, match="allocator must be one of keep, system"):
        Options(allocator="jemalloc")
