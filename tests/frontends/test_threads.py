"""A compiled model called from several threads at once: each call's results are its own."""
from __future__ import annotations

import threading
import warnings

import pytest
import torch

import opweave


class _Prologue(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x * 2 + 1)


def _lowered_steps(compiled):
    return [seg.executor.lowered_steps or [] for seg in compiled.program.steps
            if hasattr(seg, "executor")]


# calls from threads: the warning about libgomp's waits is pinned in test_openmp_waits
@pytest.mark.filterwarnings("ignore::opweave.notices.OpweavePerformanceWarning")
def test_two_threads_calling_one_compiled_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        _Prologue(),  # elementwise ops no library call absorbs: a generated kernel for sure
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16), torch.nn.Softmax(-1),
    ).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = opweave.compile(model, (torch.randn(1024, 32),), fusion="ilp")
    kinds = {step.kind for graph_steps in _lowered_steps(compiled) for step in graph_steps}
    assert "cpp" in kinds, kinds  # generated kernels run (library calls too, where measured faster)
    # 1024 rows: the kernels take their OpenMP-parallel paths, from both threads at once
    inputs = [[torch.randn(1024, 32) * (t + 1) for _ in range(50)] for t in range(2)]
    with torch.no_grad():
        expected = [[model(x) for x in xs] for xs in inputs]
    results: list[list] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def work(t: int) -> None:
        try:
            start.wait()
            for x in inputs[t]:
                results[t].append(compiled(x))
        except BaseException as error:  # noqa: BLE001 (reported by the main thread)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for t in range(2):
        assert len(results[t]) == 50
        for got, want in zip(results[t], expected[t]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
