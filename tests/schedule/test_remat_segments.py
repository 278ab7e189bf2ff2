"""Segment checkpointing (schedule/remat/segments.py): cuts at a transformer's block
boundaries, recomputation of each segment before its backward, and the plans it makes
where the MILP is not tried (a graph too large for it, as BERT-base's training step)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import opweave
from opweave import Options
from opweave.bench.memory import peak_allocated_during
from opweave.schedule import remat
from opweave.schedule.remat import greedy, segments

OPTIONS = Options(deterministic=True, measure=False, tuning_db=None, native="off")
DEPTH = 4


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention, then a GELU MLP, each with a residual."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, w)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Encoder(torch.nn.Module):
    """Activations (sequence 256) outweigh the weights, as in the benchmark models."""

    def __init__(self, width=64, heads=4, depth=DEPTH):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean(1)), y)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    model = Encoder()
    inputs = (torch.randn(4, 256, 64), torch.randint(0, 10, (4,)))
    return model, inputs


def _problem(model, inputs):
    # a budget the steps' own order meets: the steps a budget compiles to, none recomputed
    compiled = opweave.compile(model, inputs, train=True, options=OPTIONS, memory_budget=1.0)
    (graph,) = compiled.programs[True].compiled_graphs
    return remat.analyse(graph.executor.lowered.steps, graph.graph)


def test_cuts_fall_between_blocks_and_segments_go_below_the_greedy_floor(encoder):
    problem = _problem(*encoder)
    end = segments.forward_end(problem)
    cross = segments.crossing_bytes(problem, end)
    cuts = segments.candidate_cuts(problem, end)
    assert len(cuts) >= DEPTH  # a block's two residual adds each leave one stream
    residual = 4 * 256 * 64 * 4
    assert all(cross[c] <= 1.5 * residual for c in cuts[1:])
    unconstrained = remat.simulate_peak(problem, range(problem.n))
    floor = remat.simulate_peak(
        problem, greedy.recompute_at_peaks(problem, list(range(problem.n)), 0))
    found = segments.orders(problem)
    assert found
    peaks = []
    for order in found:
        remat.validate(problem, order)
        assert sorted(set(order)) == list(range(problem.n))
        peaks.append(remat.simulate_peak(problem, order))
    assert min(peaks) < 0.4 * unconstrained and min(peaks) < floor


def _step(model, compiled, inputs):
    model.zero_grad(set_to_none=True)
    loss = compiled(*inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_graph_too_large_for_the_milp_meets_a_low_budget_by_segments(encoder, monkeypatch):
    model, inputs = encoder
    monkeypatch.setattr(remat, "MILP_MAX_COLUMNS", 0)
    free = opweave.compile(model, inputs, train=True, options=OPTIONS)
    bounded = opweave.compile(model, inputs, train=True, options=OPTIONS, memory_budget=0.35)
    loss, grads = _step(model, free, inputs)
    loss_b, grads_b = _step(model, bounded, inputs)
    (graph,) = bounded.programs[True].compiled_graphs
    plan = graph.report("remat")
    assert plan.method == "segments", plan
    assert plan.predicted_peak <= plan.budget
    assert torch.equal(loss, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_b))
    measured = peak_allocated_during(lambda: bounded(*inputs).backward())
    assert abs(measured - plan.predicted_peak) <= 0.1 * plan.predicted_peak
