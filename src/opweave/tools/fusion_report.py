"""`opweave fusion-report`: the ILP and greedy partitioners side by side on the models."""
from __future__ import annotations

import warnings

import torch

from ..codegen.render import FUSIBLE
from ..partition import clear_cache, partition


def compare(model_names, small: bool = False) -> str:
    """A markdown table: per model and partitioner, fused groups, kernel steps, estimated
    time and solve time, over the rewritten IR graphs. Anchor groups are costed by
    measurement, as in compilation (shared by both partitioners, and not in solve time);
    the rest by the roofline."""
    from .. import models
    from ..frontends.torch_export import compile as compile_model

    rows = ["| model | partitioner | fused groups | steps | nodes | est. ms | solve s | cache hits | notes |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name in model_names:
        bench = models.build(name, small=small)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graphs = compile_model(bench.module.eval(), bench.inputs, fusion="off").graphs
        for g in graphs:  # measure every anchor candidate first: solve times exclude it
            partition(g, "ilp", FUSIBLE, anchor_seconds=_measured(g))
        for method in ("ilp", "greedy"):
            clear_cache()
            parts = [partition(g, method, FUSIBLE, anchor_seconds=_measured(g)) for g in graphs]
            fused = sum(len(p.fused) for p in parts)
            steps = sum(len(p.groups) for p in parts)
            nodes = sum(len(p.ctx.nodes) for p in parts)
            est = sum(p.estimated_seconds() for p in parts) * 1e3
            solve = sum(p.seconds for p in parts)
            hits = sum(p.cache_hits for p in parts)
            notes = "; ".join(n for p in parts for n in p.notes)
            rows.append(f"| {name} | {method} | {fused} | {steps} | {nodes} | {est:.3f} | "
                        f"{solve:.3f} | {hits} | {notes} |")
    torch._dynamo.reset()
    return "\n".join(rows)


def _measured(graph):
    from ..codegen.lower import measured_anchor_seconds

    return lambda ctx, group: measured_anchor_seconds(graph, ctx, group)
