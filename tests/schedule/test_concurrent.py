"""Concurrent stages on the native plan (schedule/concurrent.py): the steps' dependences,
the staged plan's frees, its results against the plan run step by step, and the decision
(measured, remembered, explained)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import opweave
from opweave import Options
from opweave.passes.rewrite.pipeline import RewriteOptions
from opweave.ir import Graph, TensorType
from opweave.pipeline import compile_graph
from opweave.runtime.native import PlanLayout
from opweave.schedule import concurrent, stages as st
from opweave.tune import TuningDB

from ..conftest import small_model

OPTIONS = Options(deterministic=True, measure=False, native="wait", tuning_db=None,
                  schedule="ios", rewrite=RewriteOptions.resolve("off"))


@pytest.fixture
def flat_costs(monkeypatch):
    """Every step costs the same on one thread as on all, a fork and join next to nothing,
    and every stage as it runs nothing: the schedule runs independent steps side by side
    wherever it can, whatever this machine measures."""
    def flat(plan, layout, inputs, threads, repeats=1):
        n = len(layout.step_starts) - 1
        return {t: [1e-4] * n for t in threads}

    monkeypatch.setattr(concurrent, "measure_costs", flat)
    monkeypatch.setattr(concurrent, "measure_sync", lambda cores: 1e-6)
    # and no stage is ever measured slower than its steps (none is split back)
    monkeypatch.setattr(concurrent, "measure_stages",
                        lambda plan, layout, inputs, stages, repeats=3: [0.0] * stages)


def _branches(width: int = 3, size: int = 48) -> Graph:
    """`width` independent products of one input, each with its own pointwise tail,
    joined by adds: steps that may run side by side."""
    g = Graph("branches")
    x = g.add_input("x", TensorType((size, size), torch.float32))
    tails = []
    for b in range(width):
        w = g.add_constant(f"w{b}", torch.randn(size, size) / size ** 0.5)
        y = g.add1("matmul", [x, w])
        tails.append(g.add1("tanh", [g.add1("mul", [y, y])]))
    out = tails[0]
    for t in tails[1:]:
        out = g.add1("add", [out, t])
    g.outputs = [out, tails[-1]]
    return g


def _staged(executor, inputs, adopt="always"):
    """The executor with its stages decided (kept whatever they measured, by default)."""
    executor.staging.adopt = adopt
    for _ in range(4):  # record, check, activate, then decide
        executor(*inputs)
    assert executor.staging.decided
    return executor


def _one_thread_stages(executor):
    """The executor's schedule with every group, concurrent or not, on one thread."""
    staging = executor.staging
    assert staging.stages is not None, staging.reason
    assert any(len(s.groups) > 1 for s in staging.stages), "no concurrent stage to test"
    single = [st.Stage(s.groups, (1,) * len(s.groups)) for s in staging.stages]
    return concurrent.plan_stages(single, executor.native.layout, 1)


@pytest.mark.parametrize("source", ["branches", "zoo-inception", "xmlcnn"])
def test_concurrent_stages_compute_bit_for_bit_what_the_steps_one_after_another_do(
        source, flat_costs):
    """Every kernel on one thread either way, so only the order of independent steps
    differs: the outputs must be identical, bit for bit."""
    if source == "branches":
        executor = compile_graph(_branches(), OPTIONS).executor
        inputs = [torch.randn(48, 48)]
    else:
        bench = small_model(source)
        compiled = opweave.compile(bench.module.eval(), bench.inputs, options=OPTIONS)
        (graph,) = compiled.program.compiled_graphs
        executor, inputs = graph.executor, list(bench.inputs)
    with torch.no_grad():
        _staged(executor, inputs)
        plan = executor.native.plan
        spec, frees = _one_thread_stages(executor)
        plan.set_stages(spec, frees)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(3):
                plan.use_stages(False)
                expected = plan.run(inputs)
                plan.use_stages(True)
                got = plan.run(inputs)
                assert len(got) == len(expected)
                for a, b in zip(expected, got):
                    assert torch.equal(a, b)
        finally:
            torch.set_num_threads(threads)
            plan.use_stages(False)


def test_a_kept_schedule_runs_the_compiled_model_and_agrees_with_eager(flat_costs):
    bench = small_model("zoo-inception")
    module = bench.module.eval()
    compiled = opweave.compile(module, bench.inputs, options=OPTIONS)
    (graph,) = compiled.program.compiled_graphs
    with torch.no_grad():
        _staged(graph.executor, list(bench.inputs))
        assert graph.executor.native.plan.staged
        expected = module(*bench.inputs)
        for _ in range(3):
            torch.testing.assert_close(compiled(*bench.inputs), expected, rtol=1e-4, atol=1e-5)


def _conv(g, x, channels, k, name):
    w = g.add_constant(f"{name}_w", torch.randn(channels, channels, k, k) / (channels * k) ** 0.5)
    b = g.add_constant(f"{name}_b", torch.randn(channels))
    return g.add1("conv", [x, w, b], {"stride": [1, 1], "padding": [k // 2] * 2,
                                      "dilation": [1, 1]})


def test_steps_follow_what_they_read_and_an_in_place_step_every_other_reader(flat_costs):
    """The last convolution adds into its residual's storage (the residual is dead after
    it in the order the steps were lowered in), so every other reader of the residual
    must run before it, whatever the schedule."""
    g = Graph("inplace")
    x = g.add_input("x", TensorType((1, 16, 6, 6), torch.float32))
    r = g.add1("relu", [_conv(g, x, 16, 1, "c0")])                 # the residual
    side = g.add1("sum", [g.add1("tanh", [r])], {"dims": [1]})      # another reader of it
    h = g.add1("relu", [_conv(g, r, 16, 3, "c1")])
    y = g.add1("relu", [g.add1("add", [_conv(g, h, 16, 1, "c2"), r])])
    g.outputs = [y, side]
    executor = compile_graph(g, dataclasses.replace(OPTIONS, measure=False)).executor
    written = [k for k, s in enumerate(executor.overwritten) if s is not None]
    assert written, [s.name for s in executor.lowered_steps]
    costs = {t: [1e-4] * len(executor._steps) for t in (1, 2)}
    problem = concurrent.step_problem(executor, costs, 2, 1e-6)
    for k in written:
        slot = executor.overwritten[k]
        readers = {j for j, (_, ins, _, _) in enumerate(executor._steps) if slot in ins} - {k}
        assert len(readers) >= 2 and readers <= problem.preds[k]
    for k, (_, ins, _, _) in enumerate(executor._steps):
        for j, (_, _, outs, _) in enumerate(executor._steps[:k]):
            if set(ins) & set(outs):
                assert j in problem.preds[k]
    inp = torch.randn(1, 16, 6, 6)
    reference = compile_graph(g, dataclasses.replace(OPTIONS, schedule="sequential",
                                                     fusion="off")).executor
    expected = reference(inp)
    with torch.no_grad():
        _staged(executor, [inp])
        assert executor.native.plan.staged, executor.staging.reason
        for _ in range(3):
            for a, b in zip(executor(inp), expected):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_slot_shared_by_concurrent_groups_is_dropped_after_the_stage():
    """Instruction 0 makes slot 5, read by both groups of the next stage (instructions 1
    and 2); slot 9 lives inside instruction 1; instruction 3 reads 6 and 8 and makes the
    output, slot 7."""
    layout = PlanLayout(step_starts=[0, 1, 2, 3, 4], instructions=4,
                        touched=[[5], [5, 6, 9], [5, 8], [6, 8, 7]], keep={7})
    schedule = [st.Stage(((0,),), (2,)), st.Stage(((1,), (2,)), (1, 1)), st.Stage(((3,),), (2,))]
    spec, stage_frees = concurrent.plan_stages(schedule, layout, 2)
    assert [[g[0] for g in stage] for stage in spec] == [[[0]], [[1], [2]], [[3]]]
    assert [[g[2] for g in stage] for stage in spec] == [[2], [1, 1], [2]]
    assert stage_frees == [[], [5], []]
    assert spec[1][0][1] == [[9]] and spec[1][1][1] == [[]]
    assert sorted(spec[2][0][1][0]) == [6, 8]


def test_instructions_around_the_steps_get_stages_of_their_own():
    layout = PlanLayout(step_starts=[1, 2, 3], instructions=4,
                        touched=[[0], [0, 1], [0, 2], [1, 2, 3]], keep={3})
    spec, _ = concurrent.plan_stages([st.Stage(((0,), (1,)), (1, 1))], layout, 2)
    assert [[g[0] for g in stage] for stage in spec] == [[[0]], [[1], [2]], [[3]]]
    assert [g[2] for g in spec[0]] == [2] and [g[2] for g in spec[2]] == [2]


def test_the_decision_is_remembered_and_reused_without_measuring(tmp_path, monkeypatch):
    db = TuningDB(tmp_path / "tuning.sqlite")
    options = dataclasses.replace(OPTIONS, tuning_db=str(tmp_path / "tuning.sqlite"))
    x = torch.randn(48, 48)
    torch.manual_seed(0)
    first = compile_graph(_branches(), options).executor
    first.staging.db = db
    with torch.no_grad():
        for _ in range(4):
            first(x)
    assert first.staging.decided and first.staging.estimate is not None
    (record,) = [r for r in db.records() if r.kind == concurrent.KIND]
    assert record.config["form"] in ("staged", "sequential")
    assert len(record.config["costs"]["1"]) == len(first._steps)

    def no_measuring(*args, **kwargs):
        raise AssertionError("the recorded costs should have been used")

    monkeypatch.setattr(concurrent, "measure_costs", no_measuring)
    torch.manual_seed(0)  # the same weights
    second = compile_graph(_branches(), options).executor
    second.staging.db = db
    with torch.no_grad():
        for _ in range(4):
            out = second(x)
    assert second.staging.decided and second.staging.recalled
    assert "failed" not in second.staging.reason
    assert "tuning database" in "\n".join(second.staging.describe())
    torch.testing.assert_close(out, first(x))


def test_recorded_costs_that_do_not_fit_the_steps_are_measured_again():
    record = type("R", (), {"config": {"costs": {"1": [1.0, 2.0], "2": [0.5]}}})()
    assert concurrent._recorded_costs(record, 2) is None
    record.config = {"costs": "garbage"}
    assert concurrent._recorded_costs(record, 2) is None
    record.config = {"costs": {"1": [1.0, 2.0], "2": [0.5, 1.0]}}
    assert concurrent._recorded_costs(record, 2) == {1: [1.0, 2.0], 2: [0.5, 1.0]}


def test_graphs_drawing_random_numbers_stay_sequential():
    g = Graph("random")
    x = g.add_input("x", TensorType((8, 8), torch.float32))
    a, _ = g.add("dropout", [x], {"p": 0.5})
    b = g.add1("tanh", [x])
    g.outputs = [g.add1("add", [a, b])]
    executor = compile_graph(g, OPTIONS).executor
    _staged(executor, [torch.randn(8, 8)])
    assert executor.staging.stages is None
    assert "random" in executor.staging.reason


def test_one_thread_leaves_nothing_to_run_side_by_side():
    executor = compile_graph(_branches(), OPTIONS).executor
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _staged(executor, [torch.randn(48, 48)])
    finally:
        torch.set_num_threads(threads)
    assert executor.staging.stages is None and "one thread" in executor.staging.reason


def test_an_unknown_schedule_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="schedule must be one of sequential, ios, critical-path"):
        Options(schedule="parallel")
    with pytest.raises(ValueError, match="schedule"):
        opweave.compile(torch.nn.ReLU(), (torch.randn(2),), schedule="fast")


def test_sequential_compiles_carry_no_staging():
    executor = compile_graph(_branches(), dataclasses.replace(OPTIONS, schedule="sequential")
                             ).executor
    assert executor.staging is None


def test_a_failing_staged_plan_falls_back_with_one_warning(monkeypatch, flat_costs):
    executor = compile_graph(_branches(), OPTIONS).executor

    def broken(*args, **kwargs):
        raise RuntimeError("no stages today")

    monkeypatch.setattr(concurrent, "plan_stages", broken)
    x = torch.randn(48, 48)
    with pytest.warns(concurrent.StagingWarning, match="no stages today"):
        _staged(executor, [x])
    assert executor.staging.stages is None and not executor.native.plan.staged
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        executor(x)


def test_explain_shows_the_stages(flat_costs):
    bench = small_model("zoo-inception")
    report = str(opweave.explain(bench.module.eval(), bench.inputs, graph_breaks=False,
                                 schedule="ios"))
    assert "stages (ios, " in report
    assert "estimated" in report


def test_a_concurrent_stage_measured_slower_than_its_steps_is_split_back():
    """Steps 1 and 2-3 ran side by side; measured, that stage lost to its steps one after
    another on every thread, so it is split, group by group, into single steps."""
    preds = [frozenset(), frozenset({0}), frozenset({0}), frozenset({2}), frozenset({1, 3})]
    problem = st.Problem(preds, lambda i, t: 1.0 if t == 2 else 1.5, cores=2)
    schedule = [st.Stage(((0,),), (2,)), st.Stage(((1,), (2, 3)), (1, 1)),
                st.Stage(((4,),), (2,))]
    assert concurrent.losing_stages(problem, schedule, [1.0, 2.9, 1.0]) == []
    split = concurrent.losing_stages(problem, schedule, [1.0, 3.2, 1.0])
    assert split == [(1, 2, 3)]
    refined = concurrent.refine(schedule, split, 2)
    assert [s.groups for s in refined] == [((0,),), ((1,),), ((2,),), ((3,),), ((4,),)]
    assert all(s.threads == (2,) for s in refined)
    assert st.valid(problem, refined) is None


def test_the_debug_dump_writes_the_stages_once_decided(tmp_path, flat_costs):
    options = dataclasses.replace(OPTIONS, debug_dir=str(tmp_path))
    executor = compile_graph(_branches(), options).executor
    (graph_dir,) = tmp_path.iterdir()
    assert not (graph_dir / "stages.txt").exists()
    _staged(executor, [torch.randn(48, 48)])
    text = (graph_dir / "stages.txt").read_text()
    assert text.startswith("stages (ios, ") and "estimated" in text


def test_stages_are_decided_again_when_torch_changes_its_thread_count(flat_costs):
    executor = compile_graph(_branches(), OPTIONS).executor
    x = torch.randn(48, 48)
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("needs two threads to drop to one")
    _staged(executor, [x])
    assert executor.staging.threads == threads
    torch.set_num_threads(1)
    try:
        executor(x)
        assert executor.staging.decided and executor.staging.threads == 1
        assert executor.staging.stages is None and not executor.native.plan.staged
    finally:
        torch.set_num_threads(threads)
