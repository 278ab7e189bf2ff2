"""Training step time against peak memory: opweave's rematerialization at several budgets,
against eager, eager with every transformer block checkpointed (`torch.utils.checkpoint`
through transformers' `gradient_checkpointing_enable`) and Inductor's default
(min-cut recompute) partitioner.

`opweave bench --memory --models bert-base vit-b16 --batch 2 --fractions 1.0 0.6 0.4`

Every configuration runs one step per round, rounds interleaved; the time is the median.
Peak memory is measured on a step of its own: the allocator's peak (profiler allocation
events: the tensors the step makes, gradients included) and how far the process's RSS
rose during it (every configuration shares one process, so its absolute RSS would be
everyone's weights; memory glibc kept from earlier steps is reused without showing).
opweave's predicted peak is the plan's.
"""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .memory import peak_allocated_during, rss_growth_during

BERT_SEQ = 512


@dataclass
class Row:
    model: str
    config: str
    seconds: float
    allocated: int            # the allocator's peak during a step, bytes
    rss: int | None           # how far the process's RSS rose during a step, bytes
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
          "plan's peak (MiB) | RSS growth (MiB) | compile (s) |\n"
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


def measure(name: str, batch: int, fractions, runs: int, warmup: int = 1,
            small: bool = False) -> list[Row]:
    """One model's rows: eager, per-block checkpointing, Inductor, opweave per budget."""
    from ..frontends.torch_export import compile as opweave_compile
    from ..runtime import native
    from ..schedule.remat import MemoryBudgetError, planned_peak

    module, inputs = build(name, batch, small)
    steps: dict[str, Callable[[], None]] = {"eager": _eager_step(module, inputs)}
    extra: dict[str, dict] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        steps["inductor"] = _eager_step(torch.compile(module), inputs)
        steps["inductor"]()  # compile outside the measurement
        for fraction in fractions:
            label = "opweave" if fraction >= 1.0 else f"opweave budget {fraction:.0%}"
            start = time.perf_counter()
            try:
                compiled = opweave_compile(module, inputs, name=name, train=True,
                                           memory_budget=None if fraction >= 1.0 else fraction)
            except MemoryBudgetError as err:
                print(f"{name}: {label}: {err}")
                continue
            compile_seconds = time.perf_counter() - start
            graphs = compiled.programs[True].compiled_graphs
            peaks = [planned_peak(g) for g in graphs]
            extra[label] = {"predicted": peaks[0] if len(graphs) == 1 else None,
                            "plan_seconds": compile_seconds}
            steps[label] = _compiled_step(module, compiled, inputs)
    # per-block checkpointing changes the module it is enabled on: a copy of its own
    steps["checkpoint every block"] = _eager_step(_checkpointed(copy.deepcopy(module)), inputs)

    times: dict[str, list[float]] = {k: [] for k in steps}
    for label, step in steps.items():  # opweave's native plan takes over at the third call
        for _ in range(warmup + (native.RECORD_AT_CALL if label.startswith("opweave") else 0)):
            step()
    for _ in range(runs):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - start)
    rows = []
    for label, step in steps.items():
        allocated = peak_allocated_during(step)
        rss = rss_growth_during(step)
        rows.append(Row(name, label, statistics.median(times[label]), allocated, rss,
                        **extra.get(label, {})))
    return rows


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
