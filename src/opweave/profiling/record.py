"""Running a compiled model with a timer around every step.

A compiled model's call is a program of steps: segments (IR graphs run by an Executor,
each a list of kernels, library calls and single ops) and eager ops between them. The
profiler swaps each step's function for a timed one (`instrumented`, nothing of which is
on the normal path) and runs the Python steps, since the native plan replays a whole
graph in one C++ call. Every call's time is cut into *sites*: the leaves (a kernel, a
library call, an op, an eager op) and the runtime between them, so the sites' times add
up to the measured call exactly.
"""
from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..ir import Node, Value
from ..pipeline import CompiledGraph

KINDS = {
    "cpp": "generated kernel",
    "triton": "generated Triton kernel",
    "library": "library call",
    "op": "single op",
    "reference": "torch ops in sequence",
    "eager": "eager PyTorch (not compiled)",
    "runtime": "runtime between steps",
}


@dataclass
class Site:
    """One place a call spends time."""
    index: int
    kind: str                      # a key of KINDS
    name: str                      # what runs: the fused ops, the library form, the op
    graph: str = ""                # the IR graph, "" outside one
    nodes: list[Node] = field(default_factory=list)  # IR nodes it computes
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    source: str = ""               # provenance of an eager op (ir.provenance)
    kernel: object = None          # the codegen KernelSource of a generated kernel
    ns: int = 0                    # total over the profiled calls

    @property
    def label(self) -> str:
        if self.graph and self.kind != "runtime":
            return f"{self.graph}[{self.index}] {self.name}"
        return self.name


@dataclass
class Event:
    site: int
    start: int   # ns since the profile began
    end: int
    call: int    # which profiled call


@dataclass
class Recording:
    sites: list[Site]
    events: list[Event]
    calls: int
    call_ns: list[int]             # each profiled call's total
    plain_ns: list[int]            # calls as the user runs them (native plan where active)
    python_ns: list[int]           # the Python steps, untimed: the profiler's own cost
    graphs: list[CompiledGraph]
    timed_per_call: int            # timers a profiled call runs
    kept: list[int] = field(default_factory=list)  # the calls the sites' times are from

    @property
    def total_seconds(self) -> float:
        """Mean seconds of the kept calls: what every level's rows add up to."""
        return sum(self.call_ns[i] for i in self.kept) / len(self.kept) / 1e9

    def site_seconds(self, site: "Site") -> float:
        """The site's mean seconds per kept call."""
        return site.ns / len(self.kept) / 1e9

    def median(self, which: list[int]) -> float:
        return statistics.median(which) / 1e9 if which else float("nan")


class Target:
    """What to profile: a call, and the programs (CompiledProgram) or the single graph
    it may run; `outside` names what the call does outside them."""

    def __init__(self, call: Callable[[], object], programs=(), graph: CompiledGraph | None = None,
                 name: str = "model",
                 outside: str = "call: binding, checks, outputs, Python between steps"):
        self.call, self.programs, self.graph = call, list(programs), graph
        self.name, self.outside = name, outside


def record(target: Target, runs: int, warmup: int) -> Recording:
    """`warmup` calls, then `runs` rounds of three interleaved calls: as the user runs
    it, through the Python steps untimed, and timed."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    sites, graphs, layout = _sites(target)
    events: list[Event] = []
    clock = _Clock(events)
    result = Recording(sites, events, runs, [], [], [], graphs, 0)
    with torch.no_grad():
        for _ in range(warmup):
            target.call()
        for call in range(runs):
            result.plain_ns.append(_timed(target.call))
            with _instrumented(target, layout, lambda site, fn: fn):
                result.python_ns.append(_timed(target.call))
            clock.call = call
            with _instrumented(target, layout, clock.wrap):
                start = time.perf_counter_ns()
                target.call()
                end = time.perf_counter_ns()
            result.timed_per_call = len(clock.raw) + len(clock.spans)
            clock.close(start, end, layout.get("whole", 0))
            result.call_ns.append(end - start)
    # Noise on a shared machine only ever adds time: the sites' times come from the
    # calls at or below the median (the quieter half), and so does the total.
    middle = statistics.median(result.call_ns)
    result.kept = [i for i, ns in enumerate(result.call_ns) if ns <= middle]
    kept = set(result.kept)
    for e in events:
        if e.call in kept:
            sites[e.site].ns += e.end - e.start
    clock.rebase(result)
    return result


def _timed(fn) -> int:
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


class _Clock:
    """Times each wrapped step into `raw` (plain tuples: the cheapest record Python
    makes); `close` turns a call's records into Events, with runtime events for what no
    leaf covered."""

    def __init__(self, events: list[Event]):
        self.events = events
        self.call = 0
        self.raw: list[tuple[int, int, int]] = []     # leaves: (site, start, end)
        self.spans: list[tuple[int, int, int]] = []   # segments: (runtime site, start, end)

    def wrap(self, site: "_Slot", fn: Callable) -> Callable:
        now, index = time.perf_counter_ns, site.index
        append = (self.spans if site.container else self.raw).append

        def timed(*args):
            start = now()
            result = fn(*args)
            append((index, start, now()))
            return result
        return timed

    def close(self, start: int, end: int, outer: int) -> None:
        """The call's runtime sites get what its leaves did not cover: a segment's time
        between its kernels goes to the segment's runtime site, the call's time outside
        every step to `outer`."""
        call = self.call
        leaves = [Event(site, s, e, call) for site, s, e in self.raw]
        runtime = []
        for site, s_start, s_end in self.spans:
            inside = [e for e in leaves if s_start <= e.start and e.end <= s_end]
            runtime += _gaps(site, s_start, s_end, inside, call)
        steps = leaves + [Event(site, s, e, call) for site, s, e in self.spans]
        runtime += _gaps(outer, start, end, steps, call)
        self.events += leaves + runtime
        self.raw.clear()
        self.spans.clear()

    def rebase(self, result: Recording) -> None:
        """Event times from the first profiled call's start (trace timestamps)."""
        if not self.events:
            return
        origin = min(e.start for e in self.events)
        for e in self.events:
            e.start -= origin
            e.end -= origin
        self.events.sort(key=lambda e: (e.start, -e.end))


def _gaps(site: int, start: int, end: int, inside: list[Event], call: int) -> list[Event]:
    """Events of `site` covering [start, end) minus the intervals in `inside`."""
    gaps, at = [], start
    for e in sorted(inside, key=lambda e: e.start):
        if e.start > at:
            gaps.append(Event(site, at, e.start, call))
        at = max(at, e.end)
    if end > at:
        gaps.append(Event(site, at, end, call))
    return gaps


@dataclass
class _Slot:
    index: int
    container: bool = False


def _sites(target: Target):
    """The sites of `target`'s calls, and how its steps map to them: site 0 is the
    runtime outside every graph (binding arguments, checks, outputs)."""
    sites = [Site(0, "runtime", target.outside)]
    graphs: list[CompiledGraph] = []
    layout: dict = {"programs": [], "executors": []}  # (program, step -> _Slot)
    from ..frontends.lowering import source_of

    for program in target.programs:
        slots = {}
        for i, step in enumerate(program.steps):
            compiled = getattr(step, "compiled", None)
            if compiled is None:  # an eager op
                sites.append(Site(len(sites), "eager", _eager_name(step), source=source_of(step)))
                slots[i] = _Slot(sites[-1].index)
                continue
            runtime = _graph_sites(sites, graphs, layout, compiled)
            slots[i] = _Slot(runtime, container=True)
        layout["programs"].append((program, slots))
    if target.graph is not None:
        _graph_sites(sites, graphs, layout, target.graph)
    elif not target.programs:
        sites.append(Site(1, "eager", f"{target.name} (whole model in eager PyTorch)"))
        layout["whole"] = sites[-1].index
    return sites, graphs, layout


def _graph_sites(sites, graphs, layout, compiled: CompiledGraph) -> int:
    """Sites for one compiled graph's steps; returns its runtime site's index."""
    graphs.append(compiled)
    executor = compiled.executor
    name = compiled.graph.name
    runtime = len(sites)
    sites.append(Site(runtime, "runtime", f"{name}: Python between steps, input checks",
                      graph=name))
    steps = executor.lowered_steps
    slots = {}
    for j, nodes in enumerate(executor.step_nodes()):
        step = steps[j] if steps is not None else None
        kind = step.kind if step is not None else "op"
        fn = step.fn if step is not None else None
        what = step.name if step is not None and step.name else "+".join(n.op for n in nodes)
        if kind == "cpp":
            what = "fused " + "+".join(n.op for n in nodes)
        sites.append(Site(len(sites), kind, what, graph=name, nodes=nodes,
                          inputs=list(step.inputs) if step else list(nodes[0].inputs),
                          outputs=list(step.outputs) if step else list(nodes[0].outputs),
                          kernel=getattr(fn, "source", None)))
        slots[j] = _Slot(sites[-1].index)
    layout["executors"].append((executor, slots, runtime))
    return runtime


def _eager_name(node) -> str:
    from ..frontends.program import op_name

    return f"eager {op_name(node)}"


def _instrumented(target: Target, layout, wrap):
    stack = ExitStack()
    for executor, slots, _ in layout["executors"]:
        stack.enter_context(executor.instrumented(lambda j, fn, slots=slots: wrap(slots[j], fn)))
    for program, slots in layout["programs"]:
        stack.enter_context(program.instrumented(lambda i, fn, slots=slots: wrap(slots[i], fn)))
    return stack

