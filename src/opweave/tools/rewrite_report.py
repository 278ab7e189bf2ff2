"""Engines side by side on the benchmark models: what each rewrite engine finds, how long
it takes, and whether the rewritten model still computes what eager PyTorch does.

`opweave rewrite-report` prints this table (the figures in docs/rewrite.md come from it).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from ..passes.rewrite.pipeline import RewriteOptions


@dataclass
class EngineRow:
    model: str
    engine: str
    cost_before_ms: float
    cost_after_ms: float
    seconds: float
    nodes: str
    max_abs_diff: float
    fired: str


def compare(model_names, *, small: bool = False, engines=("eqsat", "greedy", "backtrack"),
            backtrack_seconds: float = 10.0) -> list[EngineRow]:
    from .. import compile as opweave_compile
    from .. import models

    rows = []
    for name in model_names:
        bench = models.build(name, small=small)
        with torch.no_grad():
            expected = torch.utils._pytree.tree_flatten(bench.eager_outputs())[0]
        for engine in engines:
            options = RewriteOptions.resolve(engine)
            if engine == "backtrack":
                options = RewriteOptions(engine="backtrack", backtrack_seconds=backtrack_seconds)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                compiled = opweave_compile(bench.module.eval(), bench.inputs, name=name,
                                           rewrite=options)
                _ = time.perf_counter() - start
                with torch.no_grad():
                    got = torch.utils._pytree.tree_flatten(compiled(*bench.inputs))[0]
            diff = max((g.double() - e.double()).abs().max().item() for g, e in zip(got, expected))
            for report in compiled.program.rewrites:
                fired = sorted(report.fired.items(), key=lambda kv: -len(kv[1]))
                rows.append(EngineRow(
                    name, engine, report.cost_before * 1e3, report.cost_after * 1e3,
                    report.seconds, f"{report.nodes_before} -> {report.nodes_after}", diff,
                    ", ".join(f"{rule} x{len(uses)}" for rule, uses in fired)))
    return rows


def markdown(rows: list[EngineRow]) -> str:
    lines = ["| model | engine | est. ms before | est. ms after | gain | time s | nodes | "
             "max abs diff vs eager | rules in the result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = r.cost_before_ms / r.cost_after_ms if r.cost_after_ms else 1.0
        lines.append(f"| {r.model} | {r.engine} | {r.cost_before_ms:.3f} | {r.cost_after_ms:.3f} | "
                     f"{gain:.3f}x | {r.seconds:.2f} | {r.nodes} | {r.max_abs_diff:.1e} | {r.fired} |")
    return "\n".join(lines)
