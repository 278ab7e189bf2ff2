"""Inter-operator schedules measured: each model compiled once, its native plan run with
its steps one after another, in FastT's critical-path stages and in IOS's stages
(schedule/concurrent.py), all three from the same step costs measured in place, timed
interleaved on the whole compiled call. The IOS column is what `schedule="ios"` runs:
the program's stages with those that measured slower than their steps split back.

`opweave bench --schedules --models zoo-inception3 zoo-squeezenet zoo-randwire xmlcnn
bert-base --threads 2`
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

SCHEDULES = ("sequential", "critical-path", "ios")
MODELS = ("zoo-inception3", "zoo-squeezenet", "zoo-randwire", "zoo-inception", "xmlcnn",
          "bert-base")


@dataclass
class Row:
    model: str
    ms: dict[str, float]              # median ms per call, per schedule
    estimate_ms: dict[str, float]     # the scheduler's estimate, per schedule
    concurrent: dict[str, int]        # concurrent stages, per schedule
    steps: int
    eager_ms: float
    max_diff: dict[str, float] = field(default_factory=dict)  # against the sequential plan

    def markdown(self) -> str:
        seq = self.ms["sequential"]
        cells = [f"{self.ms[s]:.2f} ({seq / self.ms[s]:.2f}x)" for s in SCHEDULES[1:]]
        est = [f"{self.estimate_ms[s]:.2f}" for s in SCHEDULES]
        return (f"| {self.model} | {self.steps} | {self.eager_ms:.2f} | {seq:.2f} | "
                + " | ".join(cells) + " | " + " / ".join(est) + " | "
                + " / ".join(str(self.concurrent[s]) for s in SCHEDULES[1:]) + " |")


HEADER = ("| model | steps | eager | sequential | critical path | IOS | estimated seq / cp / "
          "IOS | concurrent stages cp / IOS |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def measure(name: str, small: bool = False, rounds: int = 10, warmup: int = 2) -> Row:
    """One model: compiled once with IOS stages, which measures its steps; then the
    three schedules of those costs set on its plans in turn, each timed on the whole call."""
    from .. import models
    from ..explanation import _program
    from ..frontends.torch_export import compile as opweave_compile
    from ..options import Options
    from ..schedule import concurrent, stages as st

    bench = models.build(name, small=small)
    module, inputs = bench.module.eval(), list(bench.inputs)
    options = replace(Options.resolve(None), native="wait", schedule="ios")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = opweave_compile(module, inputs, name=name, options=options)
    executors = [g.executor for g in _program(compiled).compiled_graphs
                 if getattr(g.executor, "staging", None) is not None]
    for executor in executors:
        executor.staging.adopt = "always"  # the stages are set below, schedule by schedule
    cores = torch.get_num_threads()
    with torch.no_grad():
        for _ in range(4):  # record, check, run the plan, measure the steps
            compiled(*inputs)
        scheduled = [e for e in executors if e.staging.problem is not None]
        if not scheduled:
            why = "; ".join(f"{e.native.describe()}, {e.staging.reason}" for e in executors)
            raise RuntimeError(f"{name}: nothing to schedule ({why})")
        specs: dict[str, list] = {s: [] for s in SCHEDULES}
        estimate = dict.fromkeys(SCHEDULES, 0.0)
        concurrent_stages = dict.fromkeys(SCHEDULES, 0)
        steps = 0
        for executor in scheduled:
            problem, layout = executor.staging.problem, executor.native.layout
            steps += problem.n
            # IOS as compile runs it: its stages measured as they ran, the losing ones split
            ios = executor.staging.stages or st.sequential(problem)
            for schedule_name, schedule in (("sequential", st.sequential(problem)),
                                            ("critical-path", st.critical_path(problem)),
                                            ("ios", ios)):
                estimate[schedule_name] += st.latency(problem, schedule) * 1e3
                concurrent_stages[schedule_name] += sum(len(s.groups) > 1 for s in schedule)
                specs[schedule_name].append(concurrent.plan_stages(schedule, layout, cores))
        plans = [e.native.plan for e in scheduled]
        eager = _eager_ms(module, inputs, rounds)
        times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
        outputs = {}
        for r in range(warmup + rounds):
            order = SCHEDULES if r % 2 == 0 else SCHEDULES[::-1]
            for schedule_name in order:
                for plan, (spec, frees) in zip(plans, specs[schedule_name]):
                    plan.set_stages(spec, frees)
                    plan.use_stages(True)
                start = time.perf_counter()
                out = compiled(*inputs)
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    times[schedule_name].append(elapsed)
                outputs[schedule_name] = out
        for plan in plans:
            plan.use_stages(False)
    reference = torch.utils._pytree.tree_leaves(outputs["sequential"])
    diffs = {s: max(float((a - b).abs().max()) for a, b in zip(
        reference, torch.utils._pytree.tree_leaves(outputs[s]))) for s in SCHEDULES}
    return Row(name, {s: statistics.median(t) * 1e3 for s, t in times.items()}, estimate,
               concurrent_stages, steps, eager, diffs)


def _eager_ms(module, inputs, rounds: int) -> float:
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        module(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def table(rows: list[Row]) -> str:
    return "\n".join([HEADER, *(r.markdown() for r in rows)])
