"""Training throughput of model arrays (HFTA): N instances of a model trained as one
fused array (`opweave.horizontal`, compiled with `train=True`, one `StackedSGD` step),
against the same N trained one after another (each compiled alone), and against N
processes training one instance each at the same time (the cores shared among them).

`opweave bench --horizontal --models xmlcnn zoo-resnet18 --sizes 2 4 8`
"""
from __future__ import annotations

import multiprocessing
import queue
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

LR = 1e-3


@dataclass
class Row:
    model: str
    instances: int
    fused: float        # samples per second
    sequential: float
    processes: float

    def markdown(self) -> str:
        return (f"| {self.model} | {self.instances} | {self.sequential:.1f} | "
                f"{self.processes:.1f} | {self.fused:.1f} | {self.fused / self.sequential:.2f}x |")


HEADER = ("| model | N | one after another (samples/s) | N processes | fused (HFTA) | "
          "fused vs one after another |\n|---|---:|---:|---:|---:|---:|")


def _instances(name: str, n: int, small: bool):
    from .. import models
    from ..models.base import disable_dropout

    benches = []
    for i in range(n):
        torch.manual_seed(100 + i)
        bench = models.build(name, small=small)
        disable_dropout(bench.loss_module)
        benches.append(bench)
    return benches


def _opweave_step(module, inputs):
    from ..frontends.torch_export import compile as opweave_compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return opweave_compile(module.train(), inputs, name="hfta", train=True)


def _timed(step, steps: int, warmup: int) -> float:
    """Median seconds of one call of `step` after `warmup` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fused_seconds(benches, steps: int, warmup: int) -> float:
    from ..schedule import StackedSGD, horizontal

    array = horizontal([b.loss_module for b in benches]).train()
    inputs = [torch.stack(xs) for xs in zip(*[(*b.inputs, b.targets) for b in benches])]

    class Summed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.array = array

        def forward(self, *args):
            return self.array(*args).sum()

    compiled = _opweave_step(Summed(), tuple(inputs))
    optimizer = StackedSGD(array.parameters(), lr=LR)

    def step():
        compiled(*inputs).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _timed(step, steps, warmup)


def _solo_step(bench):
    compiled = _opweave_step(bench.loss_module, (*bench.inputs, bench.targets))
    optimizer = torch.optim.SGD(bench.loss_module.parameters(), lr=LR)

    def step():
        compiled(*bench.inputs, bench.targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def sequential_seconds(benches, steps: int, warmup: int) -> float:
    solos = [_solo_step(b) for b in benches]

    def step():
        for s in solos:
            s()
    return _timed(step, steps, warmup)


def _process_worker(name, index, small, threads, steps, warmup, barrier, results):
    torch.set_num_threads(threads)
    bench = _instances(name, index + 1, small)[-1]
    step = _solo_step(bench)
    for _ in range(warmup):
        step()
    barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    results.put(time.perf_counter() - start)


def processes_seconds(name: str, n: int, small: bool, steps: int, warmup: int,
                      cores: int) -> float:
    """Seconds per step of N processes training at once (from a common start), each with
    an equal share of the cores (at least one thread)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(n), context.Queue()
    threads = max(1, cores // n)
    workers = [context.Process(target=_process_worker,
                               args=(name, i, small, threads, steps, warmup, barrier, results))
               for i in range(n)]
    for w in workers:
        w.start()
    spans = []
    try:
        while len(spans) < n:
            try:
                spans.append(results.get(timeout=5))
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:  # the others would wait at the barrier for ever
                    raise RuntimeError(f"{len(dead)} of {n} training processes died "
                                       f"(exit codes {dead})") from None
    finally:
        for w in workers:
            if w.is_alive() and len(spans) < n:
                w.terminate()
            w.join()
    return max(spans) / steps


def measure(name: str, sizes, small: bool = False, steps: int = 5, warmup: int = 2,
            processes: bool = True) -> list[Row]:
    cores = torch.get_num_threads()
    rows = []
    for n in sizes:
        benches = _instances(name, n, small)
        samples = n * benches[0].inputs[0].shape[0]
        fused = fused_seconds(benches, steps, warmup)
        sequential = sequential_seconds(benches, steps, warmup)
        parallel = processes_seconds(name, n, small, steps, warmup, cores) if processes \
            else float("nan")
        rows.append(Row(name, n, samples / fused, samples / sequential, samples / parallel))
    return rows


def table(rows: list[Row]) -> str:
    return "\n".join([HEADER] + [r.markdown() for r in rows])
