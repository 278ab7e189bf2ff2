"""Stage scheduling on simulated costs: IOS runs independent branches side by side when
their operators scale poorly across cores and one after another when they scale well;
every schedule is valid; IOS is never slower than sequential or critical-path
scheduling (hypothesis, random DAGs)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.schedule.stages import (Problem, Stage, critical_path, ios, latency, search,
                                     sequential, valid)


def two_chains(scaling: float) -> Problem:
    """0 -> 1 and 2 -> 3, independent; a step takes 10 us on one core and 10 / scaling
    on two."""
    preds = [frozenset(), frozenset({0}), frozenset(), frozenset({2})]
    return Problem(preds, lambda i, t: 10e-6 if t == 1 else 10e-6 / scaling, cores=2,
                   sync=1e-6)


def test_branches_that_scale_poorly_run_side_by_side():
    problem = two_chains(scaling=1.25)
    schedule = ios(problem)
    assert valid(problem, schedule) is None
    assert schedule == [Stage(((0, 1), (2, 3)), (1, 1))]
    assert latency(problem, schedule) < 0.7 * latency(problem, sequential(problem))


def test_branches_that_scale_well_run_one_after_another():
    problem = two_chains(scaling=2.0)
    schedule = ios(problem)
    assert all(len(stage.groups) == 1 for stage in schedule)
    assert latency(problem, schedule) == latency(problem, sequential(problem))


def test_exclusive_steps_never_share_a_stage():
    """A step that overwrites what another reads may not run beside it."""
    base = two_chains(scaling=1.25)
    problem = Problem(base.preds, base.seconds, 2, base.sync,
                      exclusive=lambda a, b: {a, b} == {1, 3})
    for schedule in (ios(problem), critical_path(problem)):
        assert valid(problem, schedule) is None


def test_invalid_schedules_are_named():
    problem = two_chains(scaling=1.25)
    assert "before its predecessors" in valid(problem, [Stage(((1, 0),), (2,)), Stage(((2, 3),), (2,))])
    assert "exactly once" in valid(problem, sequential(problem)[:3])
    assert "threads" in valid(problem, [Stage(((0, 1), (2, 3)), (2, 2))])


@st.composite
def dags(draw):
    n = draw(st.integers(1, 7))
    preds = [frozenset(j for j in range(i) if draw(st.booleans())) for i in range(n)]
    one = [draw(st.floats(1e-6, 1e-4)) for _ in range(n)]
    speedup = [draw(st.floats(1.0, 2.0)) for _ in range(n)]
    return Problem(preds, lambda i, t: one[i] / (speedup[i] if t >= 2 else 1.0), cores=2,
                   sync=draw(st.floats(0.0, 1e-5)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dags())
def test_ios_is_valid_and_never_slower_than_the_baselines(problem):
    """Without a beam cut (these DAGs are small) the program is exact over its space,
    which holds both baselines: its own schedule is valid and as fast as theirs."""
    searched = search(problem, beam=10**6)
    assert valid(problem, searched) is None
    assert latency(problem, searched) <= latency(problem, critical_path(problem)) * (1 + 1e-9)
    schedule = ios(problem)
    assert valid(problem, schedule) is None
    assert valid(problem, critical_path(problem)) is None
    best = latency(problem, schedule)
    assert best <= latency(problem, sequential(problem)) * (1 + 1e-9)
    assert best <= latency(problem, critical_path(problem)) * (1 + 1e-9)
