"""Schedules of generated kernels: every schedule computes what the reference ops do, the
default schedule's source never changes, a tuned choice is recorded once and then only
looked up, and a recorded schedule is what a later compile builds."""
from __future__ import annotations

import shutil

import pytest
import torch

from opweave import tune
from opweave.codegen import kernel_schedule, lower
from opweave.codegen.kernel_schedule import DEFAULT, KernelSchedule
from opweave.codegen.render import render
from opweave.ir import Graph, TensorType
from opweave.options import Options
from opweave.runtime import Executor

from ..partition.graphs import attention_scores

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
F32 = torch.float32


def _elementwise(n=40000) -> Graph:
    """One flat kernel, large enough that the default schedule runs it on the team."""
    g = Graph("flat")
    x = g.add_input("x", TensorType((4, n // 4), F32))
    y = g.add_input("y", TensorType((4, n // 4), F32))
    g.outputs = [g.add1("tanh", [g.add1("mul", [x, y])])]
    return g


def _column_sum(rows=3000, cols=24) -> Graph:
    g = Graph("colsum")
    x = g.add_input("x", TensorType((rows, cols), F32))
    g.outputs = [g.add1("sum", [g.add1("exp", [x])], {"dims": [0], "keepdim": False})]
    return g


def _layer_norm(rows=300, width=96) -> Graph:
    """A residual add, layer norm and an epilogue: one row-reduction kernel."""
    g = Graph("ln")
    x = g.add_input("x", TensorType((rows, width), F32))
    r = g.add_input("r", TensorType((rows, width), F32))
    w, b = g.add_constant("w", torch.rand(width) + 0.5), g.add_constant("b", torch.randn(width))
    y = g.add("layer_norm", [g.add1("add", [x, r]), w, b],
              {"normalized_shape": [width], "eps": 1e-5})[0]
    g.outputs = [g.add1("relu", [y])]
    return g


def _row_sum() -> Graph:
    """exp, its row sum, and a division by it: a row-sum kernel with an epilogue."""
    g = Graph("rowsum")
    x = g.add_input("x", TensorType((200, 80), F32))
    e = g.add1("exp", [x])
    g.outputs = [g.add1("div", [e, g.add1("sum", [e], {"dims": [-1], "keepdim": True})])]
    return g


def _broadcast_rows() -> Graph:
    g = Graph("rows")
    x = g.add_input("x", TensorType((2, 300, 64), F32))
    b = g.add_input("b", TensorType((64,), F32))
    g.outputs = [g.add1("relu", [g.add1("add", [x, b])])]
    return g


GRAPHS = {
    "elementwise": (_elementwise, lambda: (torch.randn(4, 10000), torch.randn(4, 10000))),
    "row loop": (_broadcast_rows, lambda: (torch.randn(2, 300, 64), torch.randn(64))),
    "row reduction": (_layer_norm, lambda: (torch.randn(300, 96), torch.randn(300, 96))),
    "softmax": (lambda: attention_scores(heads=4, seq=96),
                lambda: (torch.randn(1, 4, 96, 96), torch.randn(1, 1, 1, 96))),
    "column sum": (_column_sum, lambda: (torch.randn(3000, 24),)),
    "row sum": (_row_sum, lambda: (torch.randn(200, 80),)),
}


@pytest.fixture(autouse=True)
def _forget_this_process_choices():
    kernel_schedule._CHOSEN.clear()
    yield
    kernel_schedule._CHOSEN.clear()


@pytest.fixture
def db(tmp_path):
    with tune.using(tune.open_db(tmp_path / "tuning.sqlite")) as opened:
        yield opened


def _kernel_groups(g: Graph):
    """(nodes, escapes) of each generated kernel's group, as lower rendered them."""
    for step in lower(g, "ilp", measure=False, kernels="default").steps:
        if step.kind == "cpp":
            yield step.nodes, (lambda v, outs=tuple(step.outputs): v in outs)


@pytest.mark.parametrize("kind", list(GRAPHS))
def test_every_schedule_computes_what_the_reference_ops_do(kind, db):
    build_graph, inputs = GRAPHS[kind]
    g, args = build_graph(), inputs()
    expected = Executor(g)(*args)
    seen = set()
    for schedule in kernel_schedule.space():
        lowered = _lower_with(g, schedule)
        seen.update(s.body for s in lowered.sources)
        got = Executor(g, steps=lowered.steps)(*args)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert len(seen) > 1  # the schedules are different code


def _lower_with(g: Graph, schedule: KernelSchedule):
    """`g` lowered with every generated kernel under `schedule` (recorded for it first)."""
    first = lower(g, "ilp", measure=False, kernels="default")
    kernel_schedule._CHOSEN.clear()  # what this process chose before does not count
    for src in first.sources:
        if src.name.startswith("ow_k_"):
            tune.remember(kernel_schedule.KIND, kernel_schedule.workload_key(src),
                          schedule.describe(), {schedule.describe(): [1e-6]})
    return lower(g, "ilp", measure=False, kernels="recorded")


# each kind's kernel as opweave named it before kernels had schedules: the name hashes the
# source, and records and cached objects are keyed by it
NAMES_BEFORE_SCHEDULES = {"elementwise": "ow_k_9e9014653317cbd4",
                          "column sum": "ow_k_a09f3415b0df0371",
                          "row reduction": "ow_k_153cc11a6fbd3bed",
                          "row loop": "ow_k_38fb93c0f0cfb4e1",
                          "row sum": "ow_k_fbca3a3d97168d66"}


@pytest.mark.parametrize("kind", list(NAMES_BEFORE_SCHEDULES))
def test_the_default_schedule_renders_the_source_it_always_did(kind):
    g = GRAPHS[kind][0]()
    (nodes, escapes), = list(_kernel_groups(g))
    assert render(g, nodes, escapes, DEFAULT).name == NAMES_BEFORE_SCHEDULES[kind]
    assert render(g, nodes, escapes, DEFAULT).body == render(g, nodes, escapes).body


def test_schedule_choices_show_in_the_source():
    g = _elementwise()
    (nodes, escapes), = list(_kernel_groups(g))
    one = render(g, nodes, escapes, KernelSchedule(threads="one")).body
    team = render(g, nodes, escapes, KernelSchedule(threads="team", vector=256, unroll=True)).body
    assert "omp parallel" not in one and "#pragma omp simd" in one
    assert "omp parallel for simd num_threads(ow_team())\n" in team
    assert 'prefer-vector-width=256' in team and 'optimize("unroll-loops")' in team


def test_tuning_records_each_kernel_once_and_a_warm_compile_measures_nothing(db, monkeypatch):
    g = attention_scores(heads=4, seq=96)
    timed = []
    original = kernel_schedule._time
    monkeypatch.setattr(kernel_schedule, "_time",
                        lambda forms, fns: timed.append(len(forms)) or original(forms, fns))
    tuned = lower(g, "ilp", measure=False, kernels="tune")
    assert timed and all(n > 1 for n in timed)  # each kernel against its other schedules
    records = [r for r in db.records() if r.kind == kernel_schedule.KIND]
    assert len(records) == len(timed)
    assert all(set(r.samples) >= {DEFAULT.describe()} for r in records)

    monkeypatch.setattr(kernel_schedule, "_time", lambda *a: pytest.fail("measured again"))
    kernel_schedule._CHOSEN.clear()  # another process: the records answer
    again = lower(g, "ilp", measure=False, kernels="tune")
    assert [s.body for s in again.sources] == [s.body for s in tuned.sources]
    recorded = lower(g, "ilp", measure=False, kernels="recorded")
    assert [s.body for s in recorded.sources] == [s.body for s in tuned.sources]


def test_a_recorded_schedule_is_built_and_default_mode_ignores_it(db):
    g = _elementwise()
    args = (torch.randn(4, 10000), torch.randn(4, 10000))
    serial = _lower_with(g, KernelSchedule(threads="one"))
    (src,) = serial.sources
    assert "omp parallel" not in src.body
    torch.testing.assert_close(Executor(g, steps=serial.steps)(*args)[0],
                               torch.tanh(args[0] * args[1]))
    default = lower(g, "ilp", measure=False, kernels="default")
    assert "omp parallel" in default.sources[0].body
    assert (serial.rescheduled, default.rescheduled) == (1, 0)


@pytest.mark.parametrize("faster, kept", [(kernel_schedule.MARGIN / 2, True),
                                           (2 * kernel_schedule.MARGIN, False)])
def test_the_default_stays_unless_another_schedule_is_clearly_faster(faster, kept, db,
                                                                      monkeypatch):
    monkeypatch.setattr(kernel_schedule, "_time", lambda forms, fns: {
        f: [1.0 if f == DEFAULT.describe() else 1.0 - faster] for f in forms})
    (src,) = lower(_elementwise(), "ilp", measure=False, kernels="tune").sources
    (default,) = lower(_elementwise(), "ilp", measure=False, kernels="default").sources
    (record,) = [r for r in db.records() if r.kind == kernel_schedule.KIND]
    assert (record.config["form"] == DEFAULT.describe()) == kept
    assert (src.body == default.body) == kept


def test_an_unreadable_database_leaves_kernels_on_their_default_schedules(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with tune.using(tune.open_db(blocker / "tuning.sqlite")):
        with pytest.warns(UserWarning, match="could not be read"):
            lowered = lower(_elementwise(), "ilp", measure=False, kernels="recorded")
    assert lowered.kernel_counts() == {"cpp": 1} and lowered.rescheduled == 0


def test_the_kernels_option_is_checked_and_read_from_the_environment():
    assert Options.from_env({"OPWEAVE_KERNELS": "tune"}).kernels == "tune"
    assert Options.from_env({}).kernels == "recorded"
    with pytest.raises(ValueError, match="kernels must be one of recorded, default, tune"):
        Options(kernels="fast")
    with pytest.raises(ValueError, match="kernels must be one of"):
        lower(_elementwise(), "ilp", measure=False, kernels="fast")
