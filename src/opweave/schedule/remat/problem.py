"""The rematerialization problem: lowered steps with what recomputing them needs, and
the exact liveness of any order of them.

A step's outputs own bytes unless they view an input (followed through the view ops
inside the step) or the step writes into an input (`Step.overwrites`). A storage lives
while any value viewing it does; the graph's inputs and constants are the caller's and
not counted. `live_bytes` is what the executor's frees (runtime/memory_plan.free_points)
leave alive at each step of an order; `validate` checks an order reads only what exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ... import cost
from ...ir import Graph, Value
from ...runtime.memory_plan import free_points


@dataclass
class StepFacts:
    """What the planners need to know of one lowered step."""

    reads: list[int]          # producing steps of its run-time inputs (inputs, constants: none)
    owned: int                # bytes of the storage its outputs own (views own none)
    seconds: float            # its modelled time
    recomputable: bool
    view: bool                # every output aliases an input's storage
    overwrites: int | None    # the step whose output it writes into, if any


@dataclass
class Problem:
    """The lowered steps as the planners see them."""

    steps: list                       # codegen.lower.Step, in their original order
    facts: list[StepFacts]
    graph_outputs: frozenset[Value]
    storage: dict[Value, Value | None]  # value -> the value owning its bytes (None: caller's)

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def seconds(self) -> float:
        return sum(f.seconds for f in self.facts)


def analyse(steps: Sequence, graph: Graph) -> Problem:
    """Producers, owned bytes, aliasing and costs of `steps` (codegen.lower.Step)."""
    producer: dict[Value, int] = {}
    storage: dict[Value, Value | None] = {v: None for v in graph.inputs}
    outputs = frozenset(graph.outputs)
    machine = cost.active()
    facts = []
    for i, step in enumerate(steps):
        reads = sorted({producer[v] for v in step.inputs if v in producer})
        own, view = 0, True
        overwritten = getattr(step, "overwrites", None)
        for v in step.outputs:
            base = overwritten if (overwritten is not None and v is step.outputs[0]) \
                else _aliased_input(step, v)
            if base is None:
                storage[v] = v
                own += v.type.nbytes
                view = False
            else:
                storage[v] = storage.get(base)
        for v in step.inputs:
            storage.setdefault(v, None)  # a constant
        for v in step.outputs:
            producer[v] = i
        random = any(n.opdef.is_random for n in step.nodes)
        facts.append(StepFacts(
            reads=reads, owned=own, seconds=_seconds(step, machine),
            recomputable=not random and overwritten is None and bool(step.outputs)
            and not any(v in outputs for v in step.outputs),
            view=view and bool(step.outputs),
            overwrites=producer.get(overwritten) if overwritten is not None else None))
    return Problem(list(steps), facts, outputs, storage)


def _aliased_input(step, value: Value) -> Value | None:
    """The step input whose storage `value` views, following view ops inside the step."""
    inside = set(step.nodes)
    while value not in step.inputs:
        node = value.producer
        if node is None or node not in inside or not node.opdef.is_view:
            return None
        value = node.inputs[0]
    return value


def _seconds(step, machine: cost.Machine) -> float:
    if all(n.opdef.is_view for n in step.nodes):
        return machine.view
    flops = sum(n.opdef.cost([v.type for v in n.inputs], [v.type for v in n.outputs],
                             n.attrs).flops for n in step.nodes)
    moved = sum(v.type.nbytes for v in step.inputs) + sum(v.type.nbytes for v in step.outputs)
    return machine.seconds(flops, moved)


def live_bytes(problem: Problem, order: Sequence[int]) -> list[int]:
    """Bytes alive at each position of `order` once its step's outputs exist."""
    steps = [problem.steps[i] for i in order]
    frees = free_points(steps, problem.graph_outputs)
    holders: dict[tuple[int, int], int] = {}  # storage write -> live values on it
    current: dict[Value, tuple[tuple[int, int], int]] = {}  # value -> (storage write, bytes)
    latest: dict[Value, tuple[int, int]] = {}  # owner value -> its latest storage write
    live, profile = 0, []
    for pos, step in enumerate(steps):
        for k, v in enumerate(step.outputs):
            owner = problem.storage.get(v)
            if owner is None:
                continue
            if owner is v:
                latest[v] = (pos, k)
                holders[latest[v]] = 0
                live += v.type.nbytes
            write = latest[owner]
            holders[write] += 1
            current[v] = (write, owner.type.nbytes)
        profile.append(live)
        for v in frees[pos]:
            held = current.pop(v, None)
            if held is None:
                continue
            write, nbytes = held
            holders[write] -= 1
            if holders[write] == 0:
                live -= nbytes
    return profile


def simulate_peak(problem: Problem, order: Sequence[int]) -> int:
    """The peak of `live_bytes`: what running the steps in `order` needs at most."""
    return max(live_bytes(problem, order), default=0)


def validate(problem: Problem, order: Sequence[int]) -> None:
    """AssertionError unless every step of `order` reads values written before it, and no
    value is read after a step overwrote its storage and before it is made again."""
    written: set[int] = set()
    spoiled: set[int] = set()
    for pos, i in enumerate(order):
        facts = problem.facts[i]
        for r in facts.reads:
            if r not in written or r in spoiled:
                raise AssertionError(f"position {pos}: step {i} reads step {r}'s outputs, "
                                     "which are not there")
        if facts.overwrites is not None:
            spoiled.add(facts.overwrites)
        written.add(i)
        spoiled.discard(i)
