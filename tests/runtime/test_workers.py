"""The calling thread's OpenMP workers kept off its CPU during a native plan's calls
(`workers="apart"`, native_plan.cpp's WorkersApart); `workers="system"` and placement the
user chose through OpenMP's environment leave them alone; explain says which."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from opweave.options import Options
from opweave.pipeline import compile_graph

from .test_native import OPTIONS, _fused_graph, _warm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="thread affinity of a Linux process with two CPUs or more")

# Each mode compiles a graph, calls it (the plan takes over at the third call) and reports
# every thread of the process whose affinity is narrower than the caller's. "system" runs
# first: a thread kept apart stays so for the rest of the process.
PLACEMENT = textwrap.dedent("""
    import json, os, sys, threading, torch
    from opweave.options import Options
    from opweave.pipeline import compile_graph
    from tests.runtime.test_native import _fused_graph
    torch.set_num_threads(2)
    caller, allowed = threading.get_native_id(), os.sched_getaffinity(0)
    report = {}
    for mode in sys.argv[1:]:
        executor = compile_graph(_fused_graph(), Options(
            deterministic=True, measure=False, native="wait", tuning_db=None,
            workers=mode)).executor
        for _ in range(4):
            executor(torch.randn(8, 16))
        assert executor.native.plan is not None, executor.native.describe()
        narrowed = {}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                cpus = os.sched_getaffinity(tid)
            except OSError:  # the thread ended meanwhile
                continue
            if cpus != allowed:
                narrowed[tid] = sorted(cpus)
        report[mode] = {"narrowed": narrowed, "caller": caller, "allowed": sorted(allowed)}
    print(json.dumps(report))
""")


def _placement(*modes: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PLACEMENT, *modes], capture_output=True,
                         text=True, env={**os.environ, **env}, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_apart_narrows_only_the_worker_to_every_cpu_but_one_and_system_nothing():
    report = _placement("system", "apart")
    assert report["system"]["narrowed"] == {}
    apart = report["apart"]
    narrowed = {int(tid): cpus for tid, cpus in apart["narrowed"].items()}
    assert len(narrowed) == 1, narrowed  # a team of two: one worker
    (tid, cpus), = narrowed.items()
    assert tid != apart["caller"]
    assert set(cpus) < set(apart["allowed"]) and len(cpus) == len(apart["allowed"]) - 1


def test_placement_chosen_through_openmp_is_left_alone():
    report = _placement("apart", OMP_PROC_BIND="false")
    assert report["apart"]["narrowed"] == {}


@pytest.mark.parametrize("mode", ["apart", "system"])
def test_explain_says_whether_workers_are_kept_apart_and_results_are_the_same(mode):
    options = Options(**{**OPTIONS.__dict__, "workers": mode})
    executor = compile_graph(_fused_graph(), options).executor
    _warm(executor, lambda: [torch.randn(8, 16)])
    assert executor.native.plan is not None, executor.native.describe()
    said = "OpenMP workers kept off the caller's CPU" in executor.native.describe()
    assert said == (mode == "apart")
    x = torch.randn(8, 16)
    for replayed, stepped in zip(executor(x), executor._run([x])):
        assert torch.equal(replayed, stepped)


def test_the_workers_option_is_checked_and_read_from_the_environment():
    assert Options.from_env({"OPWEAVE_WORKERS": "system"}).workers == "system"
    assert Options.from_env({}).workers == "apart"
    with pytest.raises(ValueError, match="workers must be one of apart, system"):
        Options(workers="pinned")
