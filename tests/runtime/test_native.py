"""The native execution plan: a recorded call replayed in C++ (runtime/native.py).

The suite runs with OPWEAVE_NATIVE=wait (conftest), so the module is built before the
first replay and every compiled model of the suite is replayed from its third call on.
"""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

from opweave import Options
from opweave.codegen.lower import Step
from opweave.ir import Graph, TensorType
from opweave.pipeline import compile_graph
from opweave.runtime import Executor, native

from ..conftest import compiled_small, small_model

OPTIONS = Options(deterministic=True, measure=False, native="wait", tuning_db=None)


def _fused_graph() -> Graph:
    """A GEMM on a constant weight (a library call), a fused pointwise tail (a generated
    kernel) and a row reduction: every kind of step the lowering makes."""
    g = Graph("fused")
    x = g.add_input("x", TensorType((8, 16), torch.float32))
    w = g.add_constant("w", torch.randn(16, 32))
    y = g.add1("matmul", [x, w])
    y = g.add1("tanh", [g.add1("mul", [y, y])])
    g.outputs = [g.add1("sum", [g.add1("exp", [y])], {"dims": [1]}), y]
    return g


def _warm(executor, make, calls=3):
    outputs = None
    for _ in range(calls):
        outputs = executor(*make())
    return outputs


def test_replay_takes_over_and_computes_what_the_python_steps_compute():
    compiled = compile_graph(_fused_graph(), OPTIONS)
    ex = compiled.executor
    _warm(ex, lambda: [torch.randn(8, 16)])
    assert ex.native.plan is not None, ex.native.describe()
    ops, kernels = ex.native.counts
    assert kernels >= 1 and ops >= 1
    x = torch.randn(8, 16)
    replayed = ex(x)
    stepped = ex._run([x])
    for a, b in zip(replayed, stepped):
        assert torch.equal(a, b)


def _recorded(ex, inputs):
    """(the recorder, the outputs) of one call of `ex`'s Python steps, recorded."""
    from opweave.codegen.lower import CppKernel

    assert native.module(wait=True) is not None, native.unavailable()
    recorder = native.Recorder(inputs)
    CppKernel.recording = recorder.kernel
    try:
        with recorder:
            outputs = ex._run(inputs)
    finally:
        CppKernel.recording = None
    return recorder, outputs


def test_the_plan_is_built_after_the_recorded_call_and_replays_it():
    """Instructions built during the call split the heap blocks its tensors freed (glibc
    then grows the heap); the record holds slots, not tensors, until `finish`."""
    ex = compile_graph(_fused_graph(), OPTIONS).executor
    x = torch.randn(8, 16)
    recorder, outputs = _recorded(ex, [x])
    assert len(recorder.plan) == 0 and recorder.kernels >= 1
    assert len(recorder.records) == len(recorder.touched)
    plan = recorder.finish(outputs)
    assert len(plan) == len(recorder.touched)
    for a, b in zip(plan.run([x]), outputs):
        assert torch.equal(a, b)


def _viewing_graph() -> Graph:
    """Views of views (a slice, a permute, a reshape) of the input and of a kernel's
    result, one of them an output, the others read by a kernel."""
    g = Graph("views")
    x = g.add_input("x", TensorType((4, 6, 8), torch.float32))
    part = g.add1("slice", [x], {"dim": 1, "start": 1, "end": 5})
    moved = g.add1("permute", [part], {"dims": [0, 2, 1]})
    fused = g.add1("mul", [g.add1("relu", [moved]), moved])  # a generated kernel
    flat = g.add1("reshape", [fused], {"shape": [32, 4]})
    g.outputs = [g.add1("tanh", [g.add1("slice", [flat], {"dim": 0, "start": 3, "end": 30})]),
                 g.add1("permute", [part], {"dims": [2, 1, 0]})]
    return g


def test_views_replay_as_restrides_of_their_source_wherever_it_lies():
    """A view of a plan's value is replayed as the sizes, strides and offset it gave,
    made from its first source directly (a view only another view reads makes nothing),
    and an allocation as a plain one; on an input with another storage offset, the views
    land where the Python steps' views land."""
    ex = compile_graph(_viewing_graph(), OPTIONS).executor
    base = torch.randn(3, 4, 6, 8)
    recorder, outputs = _recorded(ex, [base[0]])
    kinds = [r[0] for r in recorder.records if isinstance(r[0], str)]
    assert kinds.count("view") == 5 and "empty" in kinds
    assert not {"aten::slice", "aten::permute", "aten::view", "aten::empty"} & set(kinds), kinds
    records = list(recorder.records)
    plan = recorder.finish(outputs)
    # the slice only the permutes read and the reshape only the last slice reads make
    # nothing (they touch no slot); both permutes are made from the input (slot 0)
    views = [(r, recorder.layout.touched[i]) for i, r in enumerate(records) if r[0] == "view"]
    assert sum(not touched for _, touched in views) == 2
    assert sum(r[1] == 0 and bool(touched) for r, touched in views) == 2
    for x in (base[0], base[2], base[1].clone()):
        replayed, stepped = plan.run([x]), ex._run([x])
        for a, b in zip(replayed, stepped):
            assert a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(a, b)
        moved = replayed[1]  # a view of the input itself: the same memory
        assert moved.data_ptr() == x[:, 1:5].data_ptr()


def test_other_strides_run_the_python_steps():
    ex = compile_graph(_fused_graph(), OPTIONS).executor
    _warm(ex, lambda: [torch.randn(8, 16)])
    assert ex.native.plan is not None
    x = torch.randn(16, 8).t()  # same shape, transposed strides
    assert ex.native.plan.run([x]) is None
    for a, b in zip(ex(x), ex._run([x.contiguous()])):
        torch.testing.assert_close(a, b)


def test_outputs_are_never_overwritten_by_a_later_call():
    ex = compile_graph(_fused_graph(), OPTIONS).executor
    _warm(ex, lambda: [torch.randn(8, 16)])
    first = ex(torch.randn(8, 16))
    kept = [t.clone() for t in first]
    ex(torch.randn(8, 16))
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


def test_inputs_that_require_grad_run_the_python_steps_under_autograd():
    g = Graph("grad")
    x = g.add_input("x", TensorType((4,), torch.float32))
    g.outputs = [g.add1("mul", [x, x])]
    ex = Executor(g, native="wait")
    _warm(ex, lambda: [torch.randn(4)])
    assert ex.native.plan is not None
    x = torch.randn(4, requires_grad=True)
    (y,) = ex(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def _graph_with_step(fn):
    g = Graph("custom")
    x = g.add_input("x", TensorType((4,), torch.float32))
    y = g.add1("neg", [x])
    g.outputs = [y]
    return Executor(g, steps=[Step(fn, [x], [y], list(g.nodes), "op", "custom")],
                    native="wait")


def test_a_step_that_reads_a_value_into_python_keeps_the_python_steps():
    ex = _graph_with_step(lambda x: [x * float(x.sum())])
    x = torch.randn(4)
    for _ in range(4):
        out = ex(x)
    assert ex.native.plan is None
    assert "reads a tensor's value into Python" in ex.native.reason
    torch.testing.assert_close(out[0], x * float(x.sum()))


def test_a_replay_that_disagrees_is_refused_with_one_warning():
    calls = iter(range(1000))  # Python state the recorded call baked in as a constant
    ex = _graph_with_step(lambda x: [x + float(next(calls))])
    x = torch.zeros(4)
    with pytest.warns(native.NativeWarning, match="disagrees with the Python steps"):
        for _ in range(3):
            ex(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", native.NativeWarning)
        out = ex(x)
    assert ex.native.plan is None
    assert torch.equal(out[0], torch.full((4,), 3.0))  # the Python steps, call after call


def test_random_ops_are_replayed_with_fresh_numbers_each_call():
    ex = _graph_with_step(lambda x: [torch.rand_like(x) + x])
    x = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", native.NativeWarning)  # the check draws alike
        _warm(ex, lambda: [x])
    assert ex.native.plan is not None, ex.native.describe()
    torch.manual_seed(0)
    first = ex(x)[0]
    torch.manual_seed(0)
    assert torch.equal(ex(x)[0], first)  # the generator's numbers, as from Python
    assert not torch.equal(ex(x)[0], first)


# calls from threads: the warning about libgomp's waits is pinned in test_openmp_waits
@pytest.mark.filterwarnings("ignore::opweave.notices.OpweavePerformanceWarning")
def test_concurrent_calls_get_their_own_results():
    ex = compile_graph(_fused_graph(), OPTIONS).executor
    _warm(ex, lambda: [torch.randn(8, 16)])
    xs = [torch.randn(8, 16) for _ in range(8)]
    expected = [ex._run([x]) for x in xs]
    got: dict[int, list] = {}

    def worker(i):
        for _ in range(20):
            got[i] = ex(xs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, want in enumerate(expected):
        for a, b in zip(got[i], want):
            assert torch.equal(a, b)


@pytest.fixture
def fresh_module_state(monkeypatch):
    """This process's module state, as if nothing were loaded yet (restored after)."""
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_problem", None)
    monkeypatch.setattr(native, "_spawned", False)


def test_an_unavailable_module_leaves_the_python_steps_with_the_reason(monkeypatch,
                                                                      fresh_module_state):
    def fail(*args):
        raise native.build.BuildError("no working C++ compiler (g++): not found")

    monkeypatch.setattr(native, "_build_and_import", fail)
    g = Graph("nomodule")
    x = g.add_input("x", TensorType((4,), torch.float32))
    g.outputs = [g.add1("neg", [x])]
    ex = Executor(g, native="wait")
    with pytest.warns(native.NativeWarning, match="native runtime is unavailable"):
        out = _warm(ex, lambda: [torch.ones(4)])
    assert torch.equal(out[0], -torch.ones(4))
    assert "no working C++ compiler" in ex.native.reason


def test_background_mode_builds_in_another_process_and_never_waits(monkeypatch, tmp_path,
                                                                  fresh_module_state):
    path = tmp_path / "opweave_native-k.so"
    monkeypatch.setattr(native, "_locate", lambda: (path, "k", [], ""))
    spawned = []
    monkeypatch.setattr(native.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    assert native.module(wait=False) is None
    assert native.module(wait=False) is None
    assert len(spawned) == 1 and spawned[0][0][1:] == ["-m", "opweave.runtime.native"]
    # the builder failed: its note is the reason, said once
    native._failure_note(path).write_text("g++ failed on generated code\n")
    with pytest.warns(native.NativeWarning, match="g\\+\\+ failed"):
        assert native.module(wait=False) is None
    assert native.unavailable() == "g++ failed on generated code"


def test_the_builder_runs_at_the_lowest_priority_in_its_own_scheduling_group():
    """It runs in a session of its own, which the kernel may schedule as a group of its own
    (autogroup): nice alone would leave it half the CPU beside the compile it serves."""
    import subprocess
    import sys
    script = ("import os; from pathlib import Path; from opweave.runtime import native; "
              "grouped = native._lowest_priority(); group = Path('/proc/self/autogroup'); "
              "print(os.nice(0), grouped, group.read_text().split()[-1] if grouped else '-')")
    nice, grouped, group_nice = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True,
        start_new_session=True).stdout.split()
    assert nice == "19"
    # where the system has autogroups and let the write through, the group's nice is 19
    assert group_nice == ("19" if grouped == "True" else "-")


def test_the_off_mode_never_records():
    ex = compile_graph(_fused_graph(), Options(native="off", measure=False,
                                               deterministic=True, tuning_db=None)).executor
    _warm(ex, lambda: [torch.randn(8, 16)], calls=4)
    assert ex.native.plan is None and "native='off'" in ex.native.describe()


@pytest.mark.parametrize("name", ["bert-base", "resnet50"])
def test_benchmark_models_are_replayed_and_match_eager(name):
    bench, compiled = small_model(name), compiled_small(name)
    with torch.no_grad():
        for _ in range(3):
            compiled(*bench.inputs)
        inputs = [t.clone() if t.is_floating_point() else t for t in bench.inputs]
        if inputs[0].is_floating_point():
            inputs[0] = torch.randn_like(inputs[0])
        want = bench.module(*inputs)
        got = compiled(*inputs)
    (graph,) = compiled.program.compiled_graphs
    assert graph.executor.native.plan is not None, graph.executor.native.describe()
    torch.testing.assert_close(torch.utils._pytree.tree_leaves(got)[0],
                               torch.utils._pytree.tree_leaves(want)[0], rtol=1e-4, atol=1e-4)
