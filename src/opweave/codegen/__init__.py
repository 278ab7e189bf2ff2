"""Code generation: fused groups become library calls (oneDNN with post-ops) and generated
C++ kernels; `executor_for(graph)` is the one entry point the frontends use."""
from __future__ import annotations

from ..ir import Graph
from ..notices import warn_once
from ..runtime import Executor
from .lower import FUSION_MODES, FusionWarning, Lowered, lower, resolve_mode

def executor_for(graph: Graph, fusion=None) -> Executor:
    """An executor for `graph` running fused kernels (`fusion`: "ilp", "greedy", "off", or
    None for $OPWEAVE_FUSION, default "ilp"). If fusion fails on this graph, it warns once
    and runs the graph op by op: a fusion bug must not cost the user their model."""
    mode = resolve_mode(fusion)
    if mode == "off":
        return Executor(graph)
    try:
        lowered = lower(graph, mode)
    except Exception as err:  # noqa: BLE001  (any failure falls back, loudly)
        warn_once(f"opweave: fusion failed on {graph.name} and was skipped: "
                  f"{type(err).__name__}: {err}", FusionWarning)
        return Executor(graph)
    executor = Executor(graph, steps=lowered.steps)
    executor.lowered = lowered
    return executor


__all__ = ["executor_for", "lower", "Lowered", "FUSION_MODES", "FusionWarning", "resolve_mode"]
