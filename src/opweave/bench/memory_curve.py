"""Training step time against peak memory: opweave's rematerialization at several budgets,
against eager, eager with every transformer block checkpointed (`torch.utils.checkpoint`
through transformers' `gradient_checkpointing_enable`) and Inductor's default
(min-cut recompute) partitioner.

`opweave bench --memory --models bert-base vit-b16 --batch 2 --fractions 1.0 0.6 0.4`

Each configuration runs in a fresh process of its own, one after another: its steps'
median time, then, on a step of its own, the allocator's peak (profiler allocation
events: the tensors the step makes, gradients included) and the process's peak RSS
during a step (weights, runtime and whatever glibc keeps included: what a user sees).
opweave's predicted peak is the plan's.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .memory import peak_allocated_during, peak_rss_during

BERT_SEQ = 512


@dataclass
class Row:
    model: str
    config: str
    seconds: float
    allocated: int            # the allocator's peak during a step, bytes
    rss: int | None           # the peak RSS of the configuration's process during a step, bytes
    predicted: int | None = None  # opweave: the plan's peak (one graph only)
    plan_seconds: float | None = None  # opweave: the compile, planning included

    def markdown(self, eager: "Row") -> str:
        mib = 2 ** 20
        predicted = f"{self.predicted / mib:.0f}" if self.predicted is not None else ""
        rss = f"{self.rss / mib:.0f}" if self.rss is not None else ""
        compile_s = f"{self.plan_seconds:.0f}" if self.plan_seconds is not None else ""
        return (f"| {self.model} | {self.config} | {self.seconds * 1e3:.0f} | "
                f"{self.seconds / eager.seconds:.2f}x | {self.allocated / mib:.0f} | "
                f"{predicted} | {rss} | {compile_s} |")


HEADER = ("| model | configuration | step (ms) | time vs eager | allocator peak (MiB) | "
          "plan's peak (MiB) | peak RSS (MiB) | compile (s) |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")


def build(name: str, batch: int, small: bool = False):
    """The benchmark model's loss module (dropout off) and its inputs with targets."""
    from .. import models
    from ..models.base import disable_dropout, like_trained

    if name == "bert-base" and not small:
        torch.manual_seed(0)
        bench = models.bert("base", seq_len=BERT_SEQ)
        like_trained(bench.loss_module)
    else:
        bench = models.build(name, small=small)
    bench = bench.with_batch(batch)
    disable_dropout(bench.loss_module)
    return bench.loss_module.train(), (*bench.inputs, bench.targets)


def _eager_step(module, inputs) -> Callable[[], None]:
    def step():
        module.zero_grad(set_to_none=True)
        module(*inputs).backward()
    return step


def _checkpointed(module):
    backbone, kwargs = module.backbone, {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # the older name (transformers < 5.23)
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return module


CHECKPOINTED = "checkpoint every block"


def configurations(fractions) -> list[tuple[str, float | None]]:
    """(label, budget fraction or None) for each configuration of one model."""
    opweave = [("opweave" if f >= 1.0 else f"opweave budget {f:.0%}", f) for f in fractions]
    return [("eager", None), (CHECKPOINTED, None), ("inductor", None), *opweave]


def measure(name: str, batch: int, fractions, runs: int, warmup: int = 1,
            small: bool = False, threads: int | None = None) -> list[Row]:
    """One model's rows: eager, per-block checkpointing, Inductor, opweave per budget.

    Each configuration runs in a process of its own, one after another: in one process
    BERT-base at batch 8 was killed at 24 GiB, the configurations' weights, plans and the
    memory glibc kept from each one's steps adding up. So the peak RSS is each
    configuration's own, and its times are not interleaved with the others'."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    threads = threads or torch.get_num_threads()
    rows = []
    for label, fraction in configurations(fractions):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            row, message = pool.submit(measure_configuration, name, batch, label, fraction,
                                       runs, warmup, small, threads).result()
        if message:
            print(f"{name}: {label}: {message}", flush=True)
        if row is not None:
            rows.append(row)
    return rows


def measure_configuration(name: str, batch: int, label: str, fraction: float | None,
                          runs: int, warmup: int, small: bool,
                          threads: int) -> tuple[Row | None, str]:
    """One configuration's row, in this process (`measure` runs it in a fresh one), and a
    note. A budget no schedule meets is measured at the smallest peak found instead (no
    row when that too is refused)."""
    from ..frontends.torch_export import compile as opweave_compile
    from ..runtime import native
    from ..schedule.remat import MemoryBudgetError, planned_peak

    torch.set_num_threads(threads)
    module, inputs = build(name, batch, small)
    extra: dict = {}
    message = ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if label == "eager":
            step = _eager_step(module, inputs)
        elif label == CHECKPOINTED:
            step = _eager_step(_checkpointed(module), inputs)
        elif label == "inductor":
            step = _eager_step(torch.compile(module), inputs)
        else:
            start = time.perf_counter()
            budget = None if fraction >= 1.0 else fraction
            try:
                compiled = opweave_compile(module, inputs, name=name, train=True,
                                           memory_budget=budget)
            except MemoryBudgetError as err:  # the curve goes down to the smallest feasible
                label = f"opweave budget {err.smallest / err.unconstrained:.0%} (smallest)"
                try:
                    compiled = opweave_compile(module, inputs, name=name, train=True,
                                               memory_budget=err.smallest)
                except MemoryBudgetError as again:  # lowered to other steps this time
                    return None, f"{err}; and at that peak: {again}"
                message = f"{err}; measured at that smallest peak instead"
            graphs = compiled.programs[True].compiled_graphs
            extra = {"predicted": planned_peak(graphs[0]) if len(graphs) == 1 else None,
                     "plan_seconds": time.perf_counter() - start}
            step = _compiled_step(module, compiled, inputs)
        # compiling happens at the first call; opweave's native plan takes over at the third
        for _ in range(max(warmup, 1) + (native.RECORD_AT_CALL if label.startswith("opweave")
                                         else 0)):
            step()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        allocated = peak_allocated_during(step)
        rss = peak_rss_during(step)
    return Row(name, label, statistics.median(times), allocated, rss, **extra), message


def _compiled_step(module, compiled, inputs) -> Callable[[], None]:
    def step():
        module.zero_grad(set_to_none=True)
        compiled(*inputs).backward()
    return step


def table(rows: list[Row]) -> str:
    lines = [HEADER]
    for row in rows:
        eager = next(r for r in rows if r.model == row.model and r.config == "eager")
        lines.append(row.markdown(eager))
    return "\n".join(lines)
