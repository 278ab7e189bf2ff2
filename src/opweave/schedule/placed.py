"""Run a graph placed on the CPU and the GPU (schedule/placement.py).

Each group becomes an IR graph of its own, compiled for its device (C++ kernels and
oneDNN on the CPU, Triton kernels and torch's CUDA libraries on the GPU). A call issues
the groups in the placement's order, moving each input to the group's device first. GPU
work is queued asynchronously, so the host goes on to the next CPU group while the GPU
computes: that is where the two overlap. Inputs and outputs stay on the caller's device.

`measure_costs` times each group on each device (the placement's cost table) and the
link's bandwidth and latency, on random inputs of the graph's types.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from ..ir import Graph
from ..ir.graph import Value
from .placement import CostTable, Placement, Subgraph
from ..runtime.native import NativeState

# (group's graph, device) -> a callable running it on tensors of that device
CompileGroup = Callable[[Graph, str], Callable]


def group_graph(graph: Graph, sub: Subgraph) -> Graph:
    """The group's nodes as a graph: its inputs, the constants it reads (and their views,
    rebuilt), its outputs."""
    g = Graph(f"{graph.name}_g{sub.index}")
    mapped: dict[Value, Value] = {v: g.add_input(v.name, v.type) for v in sub.inputs}

    def value(v: Value) -> Value:
        if v not in mapped:  # a constant or a view of one: not a group's input
            p = v.producer
            if p.op == "constant":
                mapped[v] = g.add_constant(p.attrs["name"], graph.constants[p.attrs["name"]])
            else:
                outs = g.add(p.op, [value(x) for x in p.inputs], p.attrs, source=p.source)
                mapped.update(zip(p.outputs, outs))
        return mapped[v]

    for node in sub.nodes:
        outs = g.add(node.op, [value(v) for v in node.inputs], node.attrs, source=node.source)
        mapped.update(zip(node.outputs, outs))
    g.outputs = [mapped[v] for v in sub.outputs]
    return g


class PlacedExecutor:
    """Callable like an `Executor` over `graph`; each group runs where `placement` says."""

    def __init__(self, graph: Graph, groups: list[Subgraph], placement: Placement,
                 compile_group: CompileGroup):
        self.graph = graph
        self.groups = groups
        self.placement = placement
        self.native = NativeState("off", graph.name)
        self.lowered_steps = None
        self.runners = [compile_group(group_graph(graph, s), d)
                        for s, d in zip(groups, placement.devices)]
        self.devices = [torch.device(d) for d in placement.devices]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        home = _home(inputs)
        env: dict[Value, torch.Tensor] = dict(zip(self.graph.inputs, inputs))
        moved: dict[tuple[Value, str], torch.Tensor] = {}  # each value crosses once a call

        def there(v: Value, device: torch.device) -> torch.Tensor:
            key = (v, device.type)
            if key not in moved:
                moved[key] = _to(env[v], device)
            return moved[key]

        for i in self.placement.order:
            device, sub = self.devices[i], self.groups[i]
            env.update(zip(sub.outputs, self.runners[i](*[there(v, device) for v in sub.inputs])))
        return [there(v, home) for v in self.graph.outputs]

    def step_nodes(self) -> list[list]:
        return [list(self.groups[i].nodes) for i in self.placement.order]

    def instrumented(self, wrap):
        raise NotImplementedError("profiling a graph placed on both the CPU and the GPU is not "
                                  "supported; compile it with device='cpu' or device='cuda'")


class OnDevice:
    """A whole-graph executor on one device, called with tensors from another: inputs
    moved there, outputs moved back to where the inputs were (device="auto" on a graph
    placed wholly on the GPU, called with CPU tensors)."""

    def __init__(self, executor, device: str):
        self.executor = executor
        self.device = torch.device(device)

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        home = _home(inputs)
        outputs = self.executor(*[_to(t, self.device) for t in inputs])
        return [_to(t, home) for t in outputs]


def _home(inputs) -> torch.device:
    return next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device.type == device.type:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _example(v: Value, device: str) -> torch.Tensor:
    """Random floats; zeros otherwise (valid as any index)."""
    t = v.type
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def measure_costs(graph: Graph, groups: list[Subgraph], compile_group: CompileGroup,
                  devices=("cpu", "cuda"), rounds: int = 5, home: str = "cpu") -> CostTable:
    """The median time of each group on each device (after two warm-up calls) and the
    host-device link's bandwidth and latency."""
    seconds: dict[str, list[float]] = {d: [] for d in devices}
    for sub in groups:
        g = group_graph(graph, sub)
        for d in devices:
            run = compile_group(g, d)
            args = [_example(v, d) for v in g.inputs]
            seconds[d].append(_median_seconds(lambda: run(*args), d, rounds))
    bandwidth, latency = (_link() if "cuda" in devices else (16e9, 10e-6))
    return CostTable(seconds, bandwidth, latency, home)


def _median_seconds(call, device: str, rounds: int) -> float:
    for _ in range(2):
        call()
    samples = []
    for _ in range(rounds):
        _sync(device)
        t = time.perf_counter()
        call()
        _sync(device)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _link() -> tuple[float, float]:
    """(bytes per second, seconds per transfer) from pinned host memory to the GPU."""
    small, big = torch.empty(1).pin_memory(), torch.empty(1 << 22).pin_memory()  # 16 MiB
    latency = _median_seconds(lambda: small.to("cuda", non_blocking=True), "cuda", 5)
    seconds = _median_seconds(lambda: big.to("cuda", non_blocking=True), "cuda", 5)
    return big.nbytes / max(seconds - latency, 1e-9), latency
