"""One CUDA graph per compiled GPU graph: launches replayed by the driver, not Python.

At batch 1 a GPU step is a few microseconds of work behind tens of microseconds of Python
and launch overhead per kernel. From the third call (after two that compile Triton
kernels, measure their launch configurations and warm the allocator), a call is captured
into a `torch.cuda.CUDAGraph`; later calls copy their inputs into the captured inputs,
replay, and return copies of the captured outputs (a replay overwrites them, and the
caller owns what it gets). The graph's private memory pool holds every intermediate at a
fixed address, which is what the memory plan is on the CPU.

Not captured, and said once: graphs whose outputs exceed OUTPUT_LIMIT bytes (copying them
out would cost more than the launches saved: a training step's saved activations), calls
with inputs that are not all CUDA tensors or that require grad with grad enabled, and
graphs whose capture fails (a step that synchronizes with the host; the step is named).
Those run as plain launches. A call that does not fit the captured shapes runs (or is
refused by) the steps, and the graph stays for the calls that fit. While profiled, calls
run the steps, the GPU synchronized after each.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ..notices import OpweaveFallbackWarning, warn_once

WARMUP_CALLS = 2
OUTPUT_LIMIT = 16 << 20


class CudaGraphWarning(OpweaveFallbackWarning):
    """A GPU graph runs without CUDA graph replay; the message says why."""


class CudaGraphed:
    """Wraps an `Executor` on CUDA tensors; everything else is the executor's."""

    def __init__(self, executor):
        self.executor = executor
        self.calls = 0
        self.cuda_graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.why_not: str | None = None
        self.profiling = False
        self._refuse(_too_large(executor))

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def __call__(self, *inputs):
        if self.cuda_graph is not None and not self.profiling:
            if not self._fits(inputs):  # not what was captured: the steps check and run it
                return self.executor(*inputs)
            for mine, given in zip(self.static_inputs, inputs):
                mine.copy_(given)
            self.cuda_graph.replay()
            return [t.clone() for t in self.static_outputs]
        self.calls += 1
        if self.why_not is None and self.calls > WARMUP_CALLS and not self.profiling:
            if not self._plain(inputs):  # this call only: a later one may capture
                warn_once(f"opweave: graph {self.executor.graph.name} runs without CUDA graph "
                          "replay while its inputs are not all CUDA tensors or require grad",
                          CudaGraphWarning)
            else:
                self.executor._check(inputs)  # a misfit raises here, not in the capture
                try:
                    return self._capture(inputs)
                except Exception as err:  # noqa: BLE001  (capture is an optimization)
                    self.cuda_graph = None
                    self._refuse(f"its capture failed ({type(err).__name__}: {err})")
        return self.executor(*inputs)

    def _refuse(self, why: str | None) -> None:
        if why is None:
            return
        self.why_not = why
        warn_once(f"opweave: graph {self.executor.graph.name} runs without CUDA graph replay: "
                  f"{why}", CudaGraphWarning)

    @contextmanager
    def instrumented(self, wrap):
        """The profiler's timers around each step, which then runs from Python (not the
        replay), the GPU synchronized after it so a step's time is its kernels' time."""
        def synchronized(i, fn):
            def run(*args):
                out = fn(*args)
                torch.cuda.synchronize()
                return out
            return wrap(i, run)
        self.profiling = True
        try:
            with self.executor.instrumented(synchronized):
                yield
        finally:
            self.profiling = False

    def _plain(self, inputs) -> bool:
        return (all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)))

    def _fits(self, inputs) -> bool:
        return len(inputs) == len(self.static_inputs) and all(
            isinstance(t, torch.Tensor) and t.shape == s.shape and t.dtype == s.dtype
            and t.device == s.device for t, s in zip(inputs, self.static_inputs))

    def _capture(self, inputs):
        self.static_inputs = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.executor(*self.static_inputs)  # allocations settle before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        running: list[int] = []  # the step being captured, to name it if capture fails

        def named(i, fn):
            def run(*args):
                running[:] = [i]
                return fn(*args)
            return run
        try:
            with self.executor.instrumented(named), torch.cuda.graph(graph):
                self.static_outputs = list(self.executor(*self.static_inputs))
        except Exception as err:
            steps = self.executor.lowered_steps
            if running and steps is not None:
                step = steps[running[0]]
                raise RuntimeError(f"at step {running[0]} ({step.kind} {step.name}): {err}") from err
            raise
        self.cuda_graph = graph
        graph.replay()
        return [t.clone() for t in self.static_outputs]


def _too_large(executor) -> str | None:
    total = sum(v.type.nbytes for v in executor.graph.outputs)
    if not isinstance(total, int):
        return "its sizes are symbolic"
    if total > OUTPUT_LIMIT:
        return f"its outputs take {total >> 20} MiB, more than copying out of a replay pays for"
    return None
