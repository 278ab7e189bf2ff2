"""One compile for many shapes (`opweave bench --dynamic`): BERT served at several
sequence lengths and batch sizes.

Five ways to run each size, timed interleaved in one process (medians):
- eager PyTorch;
- opweave dynamic: `torch.compile(model, backend="opweave", dynamic=True)`, compiled once
  for every size (a plan per binding of the size symbols, built on first use);
- opweave export-dynamic: `opweave.compile(model, (ids,), dynamic_shapes=...)` with batch
  and sequence as `torch.export.Dim`s, compiled once likewise;
- opweave static: `opweave.compile(model, (ids,))` compiled for that size alone;
- Inductor with `dynamic=True`, compiled once.
Every compiled output is checked against eager's before timing. The first call of each
dynamic path at a new size (its specialization) is timed apart from the steady state.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .. import models

BACKENDS = ("eager", "opweave-dynamic", "opweave-export-dynamic", "opweave-static",
            "inductor-dynamic")


@dataclass
class SizeResult:
    batch: int
    seq: int
    medians_s: dict[str, float] = field(default_factory=dict)
    first_call_s: dict[str, float] = field(default_factory=dict)  # compile/specialize + run
    max_abs_diff: dict[str, float] = field(default_factory=dict)


def measure(sizes: list[tuple[int, int]], *, model_name: str = "bert-base", runs: int = 5,
            warmup: int = 1, small: bool = False, progress=print) -> list[SizeResult]:
    import opweave

    torch.manual_seed(0)
    model = models.build(model_name, small=small).module.eval()
    vocab = 1000
    torch._dynamo.reset()
    # torch.export fixes a dim whose example size is 1: the example has 2 of each
    most_batch, most_seq = (max(2, *column) for column in zip(*sizes))
    dims = {0: torch.export.Dim("batch", max=most_batch), 1: torch.export.Dim("seq", max=most_seq)}
    exported = opweave.compile(model, (torch.randint(0, vocab, (2, 2)),),
                               name=f"{model_name}_dynamic", dynamic_shapes=(dims,))
    dynamic = {"opweave-dynamic": torch.compile(model, backend="opweave", dynamic=True),
               "opweave-export-dynamic": exported,
               "inductor-dynamic": torch.compile(model, backend="inductor", dynamic=True)}
    results = []
    with torch.no_grad():
        for batch, seq in sizes:
            ids = torch.randint(0, vocab, (batch, seq))
            result = SizeResult(batch, seq)
            reference = model(ids)[0]
            # the dynamic paths first: the static compile records its measurements in the
            # tuning database, which would spare theirs at this size
            for name, fn in dynamic.items():
                start = time.perf_counter()
                fn(ids)
                result.first_call_s[name] = time.perf_counter() - start
            start = time.perf_counter()
            static = opweave.compile(model, (ids,), name=f"{model_name}_b{batch}_s{seq}")
            static(ids)
            result.first_call_s["opweave-static"] = time.perf_counter() - start
            fns = {"eager": model, **dynamic, "opweave-static": static}
            for name, fn in fns.items():
                out = fn(ids)[0]
                result.max_abs_diff[name] = (out - reference).abs().max().item()
                for _ in range(warmup):
                    fn(ids)
            samples = {name: [] for name in fns}
            for _ in range(runs):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn(ids)
                    samples[name].append(time.perf_counter() - start)
            result.medians_s = {name: statistics.median(s) for name, s in samples.items()}
            progress(row(result))
            results.append(result)
            del static, fns
    return results


def header() -> str:
    return ("| batch | seq | eager ms | opweave dynamic ms | opweave export-dynamic ms "
            "| opweave static ms | dynamic / static | export-dynamic / static "
            "| Inductor dynamic ms | dynamic vs eager | dynamic vs Inductor "
            "| first call at this size: opweave dynamic / export-dynamic / static / Inductor s "
            "| max diff |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")


def row(r: SizeResult) -> str:
    m = r.medians_s
    ms = {k: v * 1e3 for k, v in m.items()}
    first = r.first_call_s
    diff = max(r.max_abs_diff.get(k, 0.0) for k in BACKENDS[1:4])
    static = m["opweave-static"]
    return (f"| {r.batch} | {r.seq} | {ms['eager']:.1f} | {ms['opweave-dynamic']:.1f} "
            f"| {ms['opweave-export-dynamic']:.1f} | {ms['opweave-static']:.1f} "
            f"| {m['opweave-dynamic'] / static:.2f} | {m['opweave-export-dynamic'] / static:.2f} "
            f"| {ms['inductor-dynamic']:.1f} | {m['eager'] / m['opweave-dynamic']:.2f}x "
            f"| {m['inductor-dynamic'] / m['opweave-dynamic']:.2f}x "
            f"| {first['opweave-dynamic']:.1f} / {first['opweave-export-dynamic']:.1f} / "
            f"{first['opweave-static']:.1f} / {first['inductor-dynamic']:.1f} | {diff:.1e} |")
