"""The calling thread's OpenMP workers kept off its CPU by a native plan's calls
(`workers="apart"`, native_plan.cpp's WorkersApart); `workers="system"` and placement the
user chose through OpenMP's environment leave them alone; a forked child never waits on
its parent's team; explain says whether the last call kept them apart."""
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

PLACING_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")
two_cpus = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="thread affinity of a Linux process that may use two CPUs or more")

# Compiles a plan per mode and calls it (the plan takes over at the third call), then
# reports every thread but the caller whose affinity is narrower than the caller's.
# "system" goes first: workers kept apart stay so for the rest of the process. With
# "apart", the caller then moves to one CPU and another (pinned there), calls again each
# time, and finally forks a child that calls the plan.
PLACEMENT = textwrap.dedent("""
    import json, os, sys, threading, time, torch
    from opweave.ir import Graph, TensorType
    from opweave.options import Options
    from opweave.pipeline import compile_graph

    def graph():
        g = Graph("placed")
        x = g.add_input("x", TensorType((8, 16), torch.float32))
        y = g.add1("matmul", [x, g.add_constant("w", torch.randn(16, 32))])
        g.outputs = [g.add1("tanh", [g.add1("mul", [y, y])])]
        return g

    torch.set_num_threads(2)
    caller, allowed = threading.get_native_id(), os.sched_getaffinity(0)
    x = torch.randn(8, 16)

    def narrowed():
        found = {}
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                cpus = os.sched_getaffinity(tid)
            except OSError:  # the thread ended meanwhile
                continue
            if tid != caller and cpus != allowed:
                found[tid] = sorted(cpus)
        return found

    report = {"allowed": sorted(allowed)}
    for mode in sys.argv[1:]:
        executor = compile_graph(graph(), Options(
            deterministic=True, measure=False, native="wait", tuning_db=None,
            workers=mode)).executor
        for _ in range(4):
            executor(x)
        assert executor.native.plan is not None, executor.native.describe()
        report[mode] = narrowed()
        report[mode + " said"] = executor.native.plan.workers_kept_apart
    if sys.argv[-1] == "apart":
        report["moves"] = []
        for cpu in sorted(allowed)[:2]:
            os.sched_setaffinity(0, {cpu})
            executor(x)
            report["moves"].append([cpu, narrowed()])
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(len(allowed) + 1)  # more threads than CPUs: left alone
        executor(x)
        report["oversubscribed said"] = executor.native.plan.workers_kept_apart
        torch.set_num_threads(2)
        executor(x)
        child = os.fork()
        if child == 0:  # the parent's team is gone here: a region would never return
            kept = []
            for _ in range(3):
                executor(x)
                kept.append(executor.native.plan.workers_kept_apart)
            os._exit(3 if any(kept) else 0)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                report["child"] = ["returned", "placed"][os.waitstatus_to_exitcode(status) == 3]
                break
            if time.monotonic() > deadline:
                os.kill(child, 9)
                os.waitpid(child, 0)
                report["child"] = "hung"
                break
            time.sleep(0.05)
    print(json.dumps(report))
""")


def _placement(*modes: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in PLACING_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PLACEMENT, *modes], capture_output=True,
                         text=True, env={**clean, **env}, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


@two_cpus
def test_apart_keeps_the_worker_off_the_callers_cpu_wherever_it_moves():
    report = _placement("system", "apart")
    allowed = set(report["allowed"])
    assert report["system"] == {} and report["system said"] is False
    assert report["apart said"] is True
    (cpus,) = report["apart"].values()  # a team of two: one worker, narrowed by one CPU
    assert set(cpus) < allowed and len(cpus) == len(allowed) - 1
    for cpu, narrowed in report["moves"]:
        assert list(narrowed.values()) == [sorted(allowed - {cpu})], (cpu, narrowed)
    assert report["oversubscribed said"] is False
    assert report["child"] == "returned"  # its calls returned, placing nothing


@two_cpus
def test_placement_chosen_through_openmp_is_left_alone():
    report = _placement("apart", OMP_PROC_BIND="false")
    assert report["apart"] == {} and report["apart said"] is False


@pytest.mark.parametrize("mode", ["system", "apart"])
def test_explain_says_whether_the_last_call_kept_workers_apart(mode):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        executor = compile_graph(_fused_graph(), Options(**{**OPTIONS.__dict__,
                                                            "workers": mode})).executor
        _warm(executor, lambda: [torch.randn(8, 16)])
        x = torch.randn(8, 16)
        replayed = executor(x)
    finally:
        torch.set_num_threads(threads)
    assert executor.native.plan is not None, executor.native.describe()
    placeable = sys.platform.startswith("linux") and len(os.sched_getaffinity(0)) >= 2 \
        and not any(v in os.environ for v in PLACING_VARIABLES) and _libgomp_loaded()
    said = "OpenMP workers kept off the caller's CPU" in executor.native.describe()
    assert said == (mode == "apart" and placeable)
    for a, b in zip(replayed, executor._run([x])):
        assert torch.equal(a, b)


def _libgomp_loaded() -> bool:
    """Whether torch's OpenMP runtime here is GNU's (the one workers are placed under)."""
    try:
        with open("/proc/self/maps") as maps:
            return "libgomp" in maps.read()
    except OSError:
        return False


def test_the_workers_option_is_checked_and_read_from_the_environment():
    assert Options.from_env({"OPWEAVE_WORKERS": "system"}).workers == "system"
    assert Options.from_env({}).workers == "apart"
    with pytest.raises(ValueError, match="workers must be one of apart, system"):
        Options(workers="pinned")
