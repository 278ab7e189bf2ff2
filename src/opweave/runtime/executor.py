"""The reference executor: runs an IR graph on torch tensors through the registry.

It compiles the graph once into a flat list of steps over numbered slots, so a call does
no graph walking: per step it gathers inputs, calls the op and drops every value at its
last use (the memory plan's liveness), so peak memory stays at or below eager's.
With `use_arena=True`, ops that can write into a preallocated tensor write into the
plan's arena instead; that arena is held between calls, and until most kernels can write
into planned buffers it costs more peak memory than it saves (see docs/architecture.md).
`Executor(graph, steps=...)` runs lowered steps instead (codegen.lower: library calls,
generated kernels, single ops), each over several values; the interface stays
`Executor(graph)(*tensors) -> list[Tensor]`.
With `native="background"` or `"wait"`, a call is replayed by the native plan once it has
been recorded and checked (runtime/native.py); a call it does not fit (other strides, grad)
runs the steps here.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Sequence

import torch

from .. import openmp_waits
from ..ir import Graph, TensorType, verify
from .memory_plan import MemoryPlan, free_points, plan_memory
from .native import NativeState


class InputError(ValueError):
    """Inputs that do not match the graph's declared input types or the executor's device."""


class Executor:
    def __init__(self, graph: Graph, *, use_arena: bool = False, check_inputs: bool = True,
                 steps=None, native: str = "off", device: str = "cpu",
                 workers: str = "apart"):
        verify(graph)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cpu":
            native = "off"  # the native plan replays CPU kernels; CUDA graphs do this there
        self.native = NativeState(native, graph.name, workers)
        self.graph = graph
        self.plan: MemoryPlan = plan_memory(graph)
        self.use_arena = use_arena
        self.check_inputs = check_inputs
        slot = {}
        for v in graph.inputs:
            slot[v] = len(slot)
        for node in graph.nodes:
            for v in node.outputs:
                slot[v] = len(slot)
        for step in steps or ():  # values the lowering added (a kernel's result in bf16 too)
            for v in step.outputs:
                slot.setdefault(v, len(slot))
        self._num_slots = len(slot)
        self._input_slots = [slot[v] for v in graph.inputs]
        self._input_types = [v.type for v in graph.inputs]
        self._output_slots = [slot[v] for v in graph.outputs]
        # Outputs that are graph inputs or constants, or made by an op that reads no tensor
        # (computed once on a GPU, see _on), are copied: callers own what they get.
        self._copy_outputs = [v.producer is None or not v.producer.inputs for v in graph.outputs]
        self._arena: torch.Tensor | None = None
        self._arena_layout: list[tuple[int, TensorType, int]] = []  # (slot, type, byte offset)
        self._arena_views: dict[int, torch.Tensor] = {}
        self._base = [None] * self._num_slots
        self._steps: list[tuple[Callable, list[int], list[int], list[int]]] = []
        self.lowered_steps = steps
        for node in graph.nodes:
            if node.op == "constant":
                value = graph.constants[node.attrs["name"]]
                self._base[slot[node.outputs[0]]] = on_device(value, self.device)
        # the slot each step writes into in place (its output in an input's storage)
        self.overwritten: list[int | None] = []
        if steps is not None:
            self._steps = _slot_steps(steps, slot, graph)
            self.overwritten = [slot[s.overwrites] if s.overwrites is not None else None
                                for s in steps]
        else:
            for i, node in enumerate(graph.nodes):
                if node.op == "constant":
                    continue
                ins = [slot[v] for v in node.inputs]
                outs = [slot[v] for v in node.outputs]
                frees = [slot[v] for v in self.plan.frees[i]]
                self._steps.append((self._make_call(node, outs), ins, outs, frees))
                self.overwritten.append(None)
        if self.device.type != "cpu":
            self._steps = [(_on(self.device, call) if not ins else call, ins, outs, frees)
                           for call, ins, outs, frees in self._steps]
        # concurrent stages on the native plan: a schedule.concurrent.Staging the pipeline
        # attaches (schedule="ios"), decided at the first call the plan runs
        self.staging = None
        # int8 groups still to calibrate: a codegen.int8.Calibration the pipeline attaches
        # (precision="int8"); until it is done, calls run in Python and calibrate
        self.calibration = None

    def _make_call(self, node, outs):
        opdef, attrs = node.opdef, node.attrs
        value = node.outputs[0]
        if self.use_arena and value in self.plan.offsets:
            slot = outs[0]
            impl_out = opdef.impl_out

            def call(*args):
                out = self._arena_views[slot]
                impl_out(args, attrs, out)
                return (out,)
            self._arena_layout.append((slot, value.type, self.plan.offsets[value]))
            return call
        impl = opdef.impl
        if len(node.outputs) == 1:
            return lambda *args: (impl(*args, **attrs),)
        return lambda *args: impl(*args, **attrs)

    def _allocate_arena(self) -> None:
        self._arena = torch.empty(self.plan.arena_bytes, dtype=torch.uint8)
        for slot, ttype, offset in self._arena_layout:
            raw = self._arena[offset: offset + ttype.nbytes]
            self._arena_views[slot] = raw.view(ttype.dtype).view(ttype.shape)

    def _check(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self._input_types):
            raise InputError(f"graph @{self.graph.name} takes {len(self._input_types)} inputs, "
                             f"got {len(inputs)}")
        for i, (t, want) in enumerate(zip(inputs, self._input_types)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {i} (%{self.graph.inputs[i].name}) must be a tensor, "
                                 f"got {type(t).__name__}")
            if t.device != self.device or t.layout != torch.strided:
                # generated kernels read raw memory: anything else would crash them
                raise InputError(f"input {i} (%{self.graph.inputs[i].name}) is a "
                                 f"{_where(t)} tensor, expected a {self.device} "
                                 "strided tensor")
            if tuple(t.shape) != want.shape or t.dtype != want.dtype:
                raise InputError(f"input {i} (%{self.graph.inputs[i].name}) has shape "
                                 f"{list(t.shape)} and dtype {t.dtype}, expected {want}")

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        outputs = self.replay(inputs)
        if outputs is not None:
            return outputs
        native = self.native
        if self.device.type != "cpu":  # a 0-d CPU tensor (a scalar) goes where the rest are
            inputs = [t.to(self.device) if isinstance(t, torch.Tensor) and t.dim() == 0
                      and t.device != self.device else t for t in inputs]
        if self.check_inputs:
            self._check(inputs)
        calibration = self.calibration
        if calibration is not None and not calibration.done:
            return calibration.call(self._run, inputs)
        if native.pending:
            return native.call(self._run, inputs)
        return self._run(inputs)

    def replay(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The native plan's outputs for `inputs`, or None where there is no plan yet or
        the inputs are not the kind it recorded (other shapes, strides, grad: then the
        Python steps run them, in `__call__`, which checks them). A caller that has nothing
        else to do calls this directly (frontends/program.py)."""
        plan = self.native.plan
        if plan is None:
            return None
        staging = self.staging
        if staging is not None:
            if staging.stale():  # torch.set_num_threads since: decide again
                staging.reset(plan)
            if not staging.decided:
                staging.decide(self, inputs)
        if openmp_waits.watching and threading.get_ident() != openmp_waits.MAIN_THREAD:
            openmp_waits.second_thread_called()  # a plan is CPU-only (native="off" on GPUs)
        return plan.run(inputs)

    @contextmanager
    def instrumented(self, wrap: Callable[[int, Callable], Callable]):
        """Meanwhile, calls run the Python steps with step i's function replaced by
        `wrap(i, fn)` (the profiler's timers); the native plan waits. Nothing of this is
        on the normal path: profiling off costs nothing. One thread at a time."""
        saved = self._steps
        self._steps = [(wrap(i, call), ins, outs, frees)
                       for i, (call, ins, outs, frees) in enumerate(saved)]
        try:
            with self.native.suspended("suspended while profiling"):
                yield
        finally:
            self._steps = saved

    def step_nodes(self) -> list[list]:
        """The IR nodes each step computes, in step order."""
        if self.lowered_steps is not None:
            return [list(s.nodes) for s in self.lowered_steps]
        return [[n] for n in self.graph.nodes if n.op != "constant"]

    def _run(self, inputs: Sequence[torch.Tensor], mark: Callable[[int], None] | None = None
             ) -> list[torch.Tensor]:
        """The steps, from Python; `mark(k)` is told as step k begins, and `mark(len(steps))`
        after the last (the native plan's recorder, to know which instructions are whose)."""
        if self._arena is None and self.plan.offsets and self.use_arena:
            self._allocate_arena()
        env = list(self._base)
        for slot, t in zip(self._input_slots, inputs):
            env[slot] = t
        for k, (call, ins, outs, frees) in enumerate(self._steps):
            if mark is not None:
                mark(k)
            results = call(*[env[i] for i in ins])
            for slot, r in zip(outs, results):
                env[slot] = r
            for slot in frees:
                env[slot] = None
        if mark is not None:
            mark(len(self._steps))
        return [env[s].clone() if copy else env[s]
                for s, copy in zip(self._output_slots, self._copy_outputs)]


_DEVICE_COPIES: dict[tuple[int, torch.device], tuple[weakref.ref, torch.Tensor]] = {}


def on_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A constant on the device a graph runs on: itself there, else one copy per
    constant and device, shared by every executor (a dynamic graph's plans, a
    placement's groups); a constant the pipeline brought to the host (`copied_from`)
    is the tensor it came from."""
    if value.device == device:
        return value
    key = (id(value), device)
    held = _DEVICE_COPIES.get(key)
    if held is not None and held[0]() is value:
        return held[1]
    copied_from(value, value.to(device))
    return _DEVICE_COPIES[key][1]


def copied_from(value: torch.Tensor, there: torch.Tensor) -> None:
    """Record that `value` equals `there` (on another device), as long as `value` lives."""
    key = (id(value), there.device)
    _DEVICE_COPIES[key] = (weakref.ref(value), there)
    weakref.finalize(value, _DEVICE_COPIES.pop, key, None)


def _on(device: torch.device, call: Callable) -> Callable:
    """A step that reads no tensor (full, arange: values the graph fixes) runs once, its
    values moved to the device the rest run on and reused: a copy from the host cannot
    be part of a CUDA graph."""
    made: list[torch.Tensor] = []

    def run():
        if not made:
            made.extend(t.to(device) for t in call())
        return list(made)
    return run


def _where(t: torch.Tensor) -> str:
    layout = "" if t.layout == torch.strided else f" {str(t.layout).removeprefix('torch.')}"
    return f"{t.device}{layout}"


def _slot_steps(steps, slot, graph: Graph):
    """(call, input slots, output slots, slots to free) for lowered steps: a value is
    dropped after the last step that reads it, or after its own step when none does
    (graph outputs and constants never are). A step may appear more than once (a
    recomputation, schedule/remat/): each run's outputs live until their own last read."""
    frees = free_points(steps, set(graph.outputs))
    return [(step.fn, [slot[v] for v in step.inputs], [slot[v] for v in step.outputs],
             [slot[v] for v in dropped]) for step, dropped in zip(steps, frees)]
