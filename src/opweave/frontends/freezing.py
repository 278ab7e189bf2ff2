"""Inference freezing for the Dynamo backend: a graph compiled without autograd gets the
module's parameters and buffers as constants, so batch-norm folding, weight packing and
layout choices apply as they do under `opweave.compile`.

Dynamo hands parameters to the backend as ordinary graph inputs and never guards their
values, so a frozen plan must check on every call that the weights it was built from are
unchanged, and rebuild (never serve stale results) when they are not. `weights` says what
the check sees.
"""
from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx

from .weights import TensorStamp, WeightsChangedWarning

# A plan invalidated after fewer calls than this is not worth freezing: the weights change
# about as often as the model runs (e.g. an eval call after every training step).
MIN_CALLS_PER_PLAN = 8


def parameter_positions(dynamo_gm: fx.GraphModule, example_inputs) -> list[int]:
    """Positions of the Dynamo graph's inputs that are parameters, buffers or tensor
    attributes of an nn.Module (Dynamo's source says where each input came from; with
    `inline_inbuilt_nn_modules` all of a module's tensors arrive as inputs)."""
    from torch._dynamo.source import (is_from_unspecialized_nn_module_source,
                                      is_from_unspecialized_param_buffer_source)
    from torch._subclasses.fake_tensor import FakeTensor

    placeholders = [n for n in dynamo_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return []
    positions = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        source = getattr(node.meta.get("grapharg"), "source", None)
        if source is None or type(value) not in (torch.Tensor, torch.nn.Parameter):
            continue  # FakeTensor (an outer trace) and other subclasses stay inputs
        if isinstance(value, FakeTensor) or value.layout != torch.strided:
            continue
        if is_from_unspecialized_param_buffer_source(source) or \
                is_from_unspecialized_nn_module_source(source):
            positions.append(i)
    return positions


def freezable_positions(aot_gm: fx.GraphModule, dynamo_gm: fx.GraphModule,
                        example_inputs) -> list[int]:
    """The parameter positions of the AOTAutograd inference graph that may be frozen: the
    graph's inputs must match Dynamo's one for one (no deduplicated or synthetic-base
    inputs, no effect tokens), and a tensor the graph mutates (batch-norm statistics in
    train mode) stays an input."""
    placeholders = [n for n in aot_gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return []
    context = torch._guards.TracingContext.try_get()
    info = getattr(getattr(context, "fw_metadata", None), "input_info", None)
    if info is None or len(info) != len(example_inputs):
        return []
    positions = []
    for i in parameter_positions(dynamo_gm, example_inputs):
        value, fake = example_inputs[i], placeholders[i].meta.get("val")
        if info[i].mutates_data or info[i].mutates_metadata:
            continue
        if not isinstance(fake, torch.Tensor) or fake.shape != value.shape \
                or fake.dtype != value.dtype:
            continue
        positions.append(i)
    return positions


class FrozenProgram:
    """An inference graph with the tensors at `positions` frozen as constants; called with
    all of the graph's inputs (AOTAutograd's boxed convention). Rebuilds its plan when the
    frozen tensors changed, and stops freezing when they change too often."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, positions: list[int], args, build, name: str):
        self.gm = gm
        self.name = name
        self.positions = positions
        self._pick = _picker(positions)
        self._build = build  # (gm, constants, name) -> CompiledProgram
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        frozen = set(positions)
        self._runtime = _picker([i for i in range(len(self._placeholders)) if i not in frozen])
        self.rebuilds = 0
        self.frozen = True
        self._freeze(self._pick(args))

    def _freeze(self, tensors: tuple[torch.Tensor, ...]) -> None:
        constants = {self._placeholders[i]: t for i, t in zip(self.positions, tensors)}
        self.program = self._build(self.gm, constants, self.name)
        self.stamp = TensorStamp(tensors)
        self.calls = 0

    def __call__(self, args: list):
        if self.frozen:
            if not self.stamp.matches(self._pick(args)):
                self._weights_changed(args)
        self.calls += 1
        if self.frozen:
            return self.program(*self._runtime(args))
        return self.program(*args)

    def _weights_changed(self, args) -> None:
        if self.rebuilds and self.calls < MIN_CALLS_PER_PLAN:
            self.frozen = False
            self.stamp = None
            self.program = self._build(self.gm, {}, self.name)
            warnings.warn(f"opweave: the weights frozen into {self.name} changed again after "
                          f"{self.calls} call(s); it now reads them as inputs on every call "
                          "instead of freezing them", WeightsChangedWarning, stacklevel=3)
            return
        if not self.rebuilds:
            warnings.warn(f"opweave: the weights frozen into {self.name} changed after "
                          "compiling; its plan was rebuilt from the new weights",
                          WeightsChangedWarning, stacklevel=3)
        self.rebuilds += 1
        self._freeze(self._pick(args))


def _picker(positions: list[int]):
    """A function returning args[positions] as a tuple, fast (itemgetter runs in C)."""
    if not positions:
        return lambda args: ()
    getter = operator.itemgetter(*positions)
    if len(positions) == 1:
        return lambda args: (getter(args),)
    return getter
