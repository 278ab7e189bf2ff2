"""CudaGraphed's decisions, on the CPU with torch.cuda's graph API faked: capture at the
third call, replay after, a call of other shapes runs the steps and keeps the graph, a
failed capture falls back with one warning, profiling bypasses the replay. (On a GPU,
tests/frontends/test_cuda.py replays real graphs.)"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from opweave.ir import Graph, TensorType
from opweave.runtime import Executor, InputError
from opweave.runtime import cuda_graphs
from opweave.runtime.cuda_graphs import CudaGraphed, CudaGraphWarning


class _FakeGraph:
    """Replays by running the wrapped executor on the captured inputs, into the captured
    outputs (what a real replay's kernels do)."""
    owner: CudaGraphed | None = None

    def replay(self):
        owner = _FakeGraph.owner
        for out, new in zip(owner.static_outputs, owner.executor._run(owner.static_inputs)):
            out.copy_(new)


@pytest.fixture
def fake_cuda(monkeypatch):
    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(CudaGraphed, "_plain", lambda self, inputs: True)


def _graphed(name="g"):
    g = Graph(name)
    x = g.add_input("x", TensorType((4,), torch.float32))
    g.outputs = [g.add1("exp", [x])]
    wrapped = CudaGraphed(Executor(g))
    _FakeGraph.owner = wrapped
    return wrapped


def test_the_third_call_captures_and_later_calls_replay_into_fresh_outputs(fake_cuda):
    run = _graphed()
    x = torch.randn(4)
    for _ in range(cuda_graphs.WARMUP_CALLS):
        run(x)
        assert run.cuda_graph is None
    first = run(x)[0]
    assert run.cuda_graph is not None
    y = torch.randn(4)
    second = run(y)[0]
    torch.testing.assert_close(second, torch.exp(y))
    assert second is not run.static_outputs[0] and first is not second  # caller-owned copies
    torch.testing.assert_close(first, torch.exp(x))


def test_a_call_of_other_shapes_is_refused_by_the_steps_and_the_graph_stays(fake_cuda):
    run = _graphed()
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        run(torch.randn(4))
    with pytest.raises(InputError):
        run(torch.randn(5))
    assert run.cuda_graph is not None and run.why_not is None


def test_a_failed_capture_warns_once_and_runs_the_steps(fake_cuda, monkeypatch):
    run = _graphed("fails")

    def broken(self, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(CudaGraphed, "_capture", broken)
    x = torch.randn(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(cuda_graphs.WARMUP_CALLS + 3):
            torch.testing.assert_close(run(x)[0], torch.exp(x))
    said = [w for w in caught if issubclass(w.category, CudaGraphWarning)]
    assert len(said) == 1 and "capture failed" in str(said[0].message)
    assert run.cuda_graph is None


def test_profiling_runs_the_steps_not_the_replay(fake_cuda, monkeypatch):
    run = _graphed()
    for _ in range(cuda_graphs.WARMUP_CALLS + 1):
        run(torch.randn(4))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = []

    def wrap(i, fn):
        def timed(*args):
            seen.append(i)
            return fn(*args)
        return timed
    with run.instrumented(wrap):
        run(torch.randn(4))
    assert seen == [0]
