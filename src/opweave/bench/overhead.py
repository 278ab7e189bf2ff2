"""What a compiled graph costs beyond its operators: per call and per step, from Python and
natively (`opweave bench --overhead`).

Two graphs over one-element tensors, so the operators cost next to nothing: one `neg`
(the per-call cost: input checks, the call itself, returning outputs) and a chain of
`steps` of them, one step each (fusion off). The per-step cost is the chain's extra time
over the one-op graph, divided by the extra steps. Eager PyTorch running the same chain
as `torch.neg` calls from a Python loop is the reference. Timed interleaved, medians.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..ir import Graph, TensorType
from ..runtime import Executor, native


def _chain(steps: int) -> Graph:
    g = Graph(f"chain{steps}")
    v = g.add_input("x", TensorType((1,), torch.float32))
    for _ in range(steps):
        v = g.add1("neg", [v])
    g.outputs = [v]
    return g


def _eager(steps: int):
    def run(x):
        for _ in range(steps):
            x = torch.neg(x)
        return x
    return run


def measure(steps: int = 100, rounds: int = 30, calls: int = 200) -> dict[str, dict[str, float]]:
    """{"python" | "native" | "eager": {"call_us", "step_us"}}."""
    native.module(wait=True)
    x = torch.randn(1)
    candidates = {"python": (Executor(_chain(1)), Executor(_chain(steps))),
                  "native": (Executor(_chain(1), native="wait"),
                             Executor(_chain(steps), native="wait")),
                  "eager": (_eager(1), _eager(steps))}
    for one, many in candidates.values():
        for _ in range(3):
            one(x)
            many(x)
    samples = {name: ([], []) for name in candidates}
    with torch.no_grad():
        for _ in range(rounds):
            for name, fns in candidates.items():
                for fn, out in zip(fns, samples[name]):
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    out.append((time.perf_counter() - start) / calls)
    result = {}
    for name, (one, many) in samples.items():
        call, chain = statistics.median(one), statistics.median(many)
        result[name] = {"call_us": call * 1e6, "step_us": (chain - call) / (steps - 1) * 1e6}
    native_chain = candidates["native"][1].native
    if native_chain.plan is None:  # else the "native" row would time the Python steps
        raise RuntimeError(f"the native plan did not take over: {native_chain.describe()}")
    return result


def table(result: dict[str, dict[str, float]]) -> str:
    lines = ["| runtime | per call (1 op) | per step |", "|---|---:|---:|"]
    for name, row in result.items():
        lines.append(f"| {name} | {row['call_us']:.1f} us | {row['step_us']:.2f} us |")
    return "\n".join(lines)
