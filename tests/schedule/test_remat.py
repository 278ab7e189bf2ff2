"""Rematerialization under a memory budget: the plan's peak is what a step allocates, the
gradients are the unconstrained step's, and what cannot be met or recomputed is refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import opweave
from opweave import Options
from opweave.bench.memory import peak_allocated_during
from opweave.runtime.memory_plan import free_points
from opweave.schedule import remat
from opweave.schedule.remat import greedy, milp

OPTIONS = Options(deterministic=True, measure=False, tuning_db=None, native="off")


class Residual(torch.nn.Module):
    """Linear + GELU residual blocks and a classifier: activations dominate the step.
    A random op's output is never recomputed, so what is computed from it is kept too."""

    def __init__(self, width, depth, dropout=0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)
        self.dropout = dropout

    def forward(self, x, y):
        for layer in self.layers:
            x = F.gelu(layer(x)) + x
        # dropout last: what comes after a kept random output can still be recomputed
        return F.cross_entropy(self.head(F.dropout(x, self.dropout, self.training)), y)


def _inputs(rows, width):
    torch.manual_seed(0)
    return torch.randn(rows, width), torch.randint(0, 10, (rows,))


def _compiled(budget, *, rows=512, width=64, depth=3, dropout=0.0, options=OPTIONS):
    """A model, its inputs, and its step compiled without and with `budget`."""
    torch.manual_seed(0)
    model = Residual(width=width, depth=depth, dropout=dropout)
    inputs = _inputs(rows, width)
    free = opweave.compile(model, inputs, train=True, options=OPTIONS)
    bounded = opweave.compile(model, inputs, train=True, options=options, memory_budget=budget)
    return model, inputs, free, bounded


def _assert_same_step(model, first, second, inputs, seed=0):
    loss, grads = _step(model, first, inputs, seed)
    loss_b, grads_b = _step(model, second, inputs, seed)
    assert torch.equal(loss, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))


def _graph(compiled):
    (graph,) = compiled.programs[True].compiled_graphs
    return graph


def _step(model, compiled, inputs, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = compiled(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def compiled_pair():
    return _compiled(0.7, rows=2048, width=256, depth=6)


def test_budget_plan_recomputes_and_its_peak_is_what_a_step_allocates(compiled_pair):
    model, inputs, free, bounded = compiled_pair
    plan = _graph(bounded).report("remat")
    assert plan.recomputed, "a 70% budget must make the plan recompute something"
    assert plan.predicted_peak <= plan.budget < plan.unconstrained_peak
    for compiled, predicted in ((bounded, plan.predicted_peak), (free, plan.unconstrained_peak)):
        compiled(*inputs)  # first calls may measure or allocate lazily
        with torch.no_grad():
            measured = peak_allocated_during(lambda: compiled(*inputs))
        assert abs(measured - predicted) <= 0.1 * predicted, (measured, predicted)


def test_budget_keeps_loss_and_gradients_bit_identical(compiled_pair):
    model, inputs, free, bounded = compiled_pair
    _assert_same_step(model, free, bounded, inputs)


def test_budget_with_native_replay_keeps_gradients():
    native = Options(deterministic=True, measure=False, tuning_db=None, native="wait")
    model, inputs, free, bounded = _compiled(0.75, options=native)
    assert _graph(bounded).report("remat").recomputed
    for _ in range(4):  # recorded at the third call, replayed after
        _assert_same_step(model, free, bounded, inputs)


def test_random_steps_are_never_recomputed_and_gradients_follow_the_same_masks():
    model, inputs, free, bounded = _compiled(0.75, rows=2048, depth=6, dropout=0.3)
    graph = _graph(bounded)
    plan = graph.report("remat")
    steps = graph.executor.lowered.steps
    random_steps = [i for i, s in enumerate(steps) if any(n.opdef.is_random for n in s.nodes)]
    assert random_steps and plan.recomputed
    assert not set(random_steps) & set(plan.recomputed)
    _assert_same_step(model, free, bounded, inputs, seed=7)


class ReluDropout(torch.nn.Module):
    """Linear, ReLU, dropout blocks: the next linear keeps dropout's output for its weight
    gradient, so each ReLU output is kept only for its backward's `le(relu, 0)`."""

    def __init__(self, width=256, depth=4):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Dropout(0.5))
            for _ in range(depth)])
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(x)), y)


def test_relu_outputs_the_backward_only_compares_are_kept_as_masks(monkeypatch):
    from opweave.schedule.remat import masks

    torch.manual_seed(0)
    model, inputs = ReluDropout().train(), _inputs(512, 256)
    hoisted = opweave.compile(model, inputs, train=True, options=OPTIONS, memory_budget=1.0)
    monkeypatch.setattr(masks, "hoist_masks", lambda graph: [])
    kept = opweave.compile(model, inputs, train=True, options=OPTIONS, memory_budget=1.0)
    graph = _graph(hoisted)
    steps = graph.executor.lowered.steps
    alone = [i for i, s in enumerate(steps) if [n.op for n in s.nodes] == ["le"]]
    assert len(alone) == 4, "each block's mask is computed on its own, in the forward"
    relus = [i for i, s in enumerate(steps) if any(n.op == "relu" for n in s.nodes)]
    assert all(any(r < m <= r + 1 for r in relus) for m in alone)
    # four float32 ReLU outputs of 512 KiB become four one-byte masks of 128 KiB
    peak, before = remat.planned_peak(graph), remat.planned_peak(_graph(kept))
    assert before - peak >= 4 * 384 * 1024 * 0.9, (before, peak)
    hoisted(*inputs)
    with torch.no_grad():
        measured = peak_allocated_during(lambda: hoisted(*inputs))
    assert abs(measured - peak) <= 0.1 * peak, (measured, peak)
    _assert_same_step(model, hoisted, kept, inputs, seed=3)


def test_budget_below_every_schedule_is_refused_with_a_budget_that_is_met():
    torch.manual_seed(0)
    model = Residual(width=64, depth=3)
    inputs = _inputs(512, 64)
    with pytest.raises(remat.MemoryBudgetError, match="cannot be met") as caught:
        opweave.compile(model, inputs, train=True, options=OPTIONS, memory_budget=0.05)
    err = caught.value
    assert err.budget < err.smallest < err.unconstrained
    compiled = opweave.compile(model, inputs, train=True, options=OPTIONS,
                               memory_budget=err.smallest)
    assert _graph(compiled).report("remat").predicted_peak <= err.smallest


def test_smallest_peak_searches_below_the_greedy_floor_and_that_budget_is_met(compiled_pair):
    graph = _graph(compiled_pair[3])
    problem = remat.analyse(graph.executor.lowered.steps, graph.graph)
    program = milp.build(problem, milp.MAX_STAGES)
    floor = remat.simulate_peak(problem, greedy.recompute_at_peaks(problem, list(range(problem.n)), 0))
    lowest, order = remat.smallest_peak(problem, program, deterministic=True)
    remat.validate(problem, order)
    assert remat.simulate_peak(problem, order) == lowest < floor  # the MILP's probes went lower
    met = remat.plan(problem, lowest, deterministic=True)
    assert met.predicted_peak <= lowest
    with pytest.raises(remat.MemoryBudgetError) as caught:
        remat.plan(problem, lowest - 1, deterministic=True)
    assert caught.value.smallest == lowest


def test_planners_each_give_valid_orders_within_the_budget(compiled_pair):
    graph = _graph(compiled_pair[3])
    problem = remat.analyse(graph.executor.lowered.steps, graph.graph)
    budget = int(0.7 * remat.simulate_peak(problem, range(problem.n)))
    program = milp.build(problem, milp.MAX_STAGES)
    orders = [greedy.recompute_at_peaks(problem, list(range(problem.n)), budget)]
    found = milp.solve_milp(problem, program, budget, deterministic=True)
    assert found is not None
    orders.append(milp.order(problem, program, found))
    orders += [milp.order(problem, program, r)
               for r in milp.solve_relaxed(problem, program, budget, deterministic=True)]
    for order in orders:
        remat.validate(problem, order)  # raises on a read of a value not made
        assert sorted(set(order)) == list(range(problem.n))
    assert remat.simulate_peak(problem, orders[0]) <= budget
    assert remat.simulate_peak(problem, orders[1]) <= budget


def _fake_steps(spec):
    """Steps from (inputs, outputs) name lists, for liveness tests."""
    return [SimpleNamespace(inputs=list(i), outputs=list(o)) for i, o in spec]


def test_free_points_give_each_run_of_a_repeated_step_its_own_lifetime():
    # a made, read, dropped; made again (a recomputation), read, dropped
    steps = _fake_steps([([], ["a"]), (["a"], ["b"]), ([], ["a"]), (["a", "b"], ["c"])])
    frees = free_points(steps, {"c"})
    assert [sorted(f) for f in frees] == [[], ["a"], [], ["a", "b"]]


def test_free_points_drop_an_unread_output_after_its_own_step():
    steps = _fake_steps([([], ["a", "unused"]), (["a"], ["out"])])
    assert free_points(steps, {"out"}) == [["unused"], ["a"]]


def test_validate_rejects_reads_of_values_not_made_or_overwritten():
    facts = [remat.problem.StepFacts([], 4, 1.0, True, False, None),
             remat.problem.StepFacts([0], 4, 1.0, True, False, None),
             remat.problem.StepFacts([0], 0, 1.0, False, True, 0)]  # writes into step 0's
    problem = remat.Problem([None] * 3, facts, frozenset(), {})
    remat.validate(problem, [0, 1, 2])
    with pytest.raises(AssertionError, match="not there"):
        remat.validate(problem, [1, 0, 2])
    with pytest.raises(AssertionError, match="not there"):
        remat.validate(problem, [0, 2, 1])  # reads step 0's storage after step 2 wrote it
    remat.validate(problem, [0, 2, 0, 1])   # made again first: fine


@pytest.mark.parametrize("budget, error", [(0, ValueError), (-5, ValueError), (1.5, ValueError),
                                           (0.0, ValueError), ("1GB", TypeError),
                                           (True, TypeError)])
def test_invalid_memory_budgets_are_refused(budget, error):
    with pytest.raises(error, match="memory_budget"):
        Options(memory_budget=budget)


def test_explain_reports_the_peak_and_the_plan():
    torch.manual_seed(0)
    model = Residual(width=64, depth=3)
    inputs = _inputs(512, 64)
    report = str(opweave.explain(model, inputs, train=True, memory_budget=0.75,
                                 graph_breaks=False))
    assert "captured with aot-joint" in report
    assert "segment 0 memory: peak" in report and "recomputed" in report
    plain = str(opweave.explain(model, inputs, train=True, graph_breaks=False))
    assert "(no memory budget)" in plain
