"""Horizontal fusion of model arrays (HFTA, MLSys'21): N instances of one architecture,
each with its own weights, run as one model.

The instances' weights are stacked along a new leading dimension and the template
module runs under `torch.func.vmap`: vmap's batching rules are exactly HFTA's
transformation (a linear becomes a batched GEMM, a convolution a grouped convolution, a
norm or an elementwise op one op over the stacked instances), and `torch.export` traces
through them, so the fused array is an ordinary module that `opweave.compile` compiles
like any other, for inference or (with `train=True`) for training. Small models that do
not fill the machine fill it together.

    array = opweave.horizontal([m1, m2, m3, m4])         # same architecture, own weights
    out = array(x)                                       # x: [4, ...], instance i gets x[i]
    compiled = opweave.compile(array.eval(), (x,))       # one fused graph
    array.instance(2)                                    # instance 2 back, as a module

Training: the instances' losses are independent, so the gradient of their sum with
respect to the stacked weights is each instance's own gradient, stacked; `StackedSGD`
and `StackedAdam` (stacked_optim.py) step all instances at once, each with its own
hyper-parameters.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap


class ArchitectureMismatch(ValueError):
    """The models cannot be fused: not one architecture (type, weights' names, shapes,
    dtypes), or inputs not stacked per instance."""


def check_same_architecture(models: Sequence[nn.Module]) -> None:
    if len(models) < 1:
        raise ArchitectureMismatch("horizontal fusion needs at least one model")
    first = models[0]
    want = _signature(first)
    for i, model in enumerate(models[1:], 1):
        if type(model) is not type(first):
            raise ArchitectureMismatch(f"model {i} is a {type(model).__name__}, model 0 a "
                                       f"{type(first).__name__}: one architecture only")
        got = _signature(model)
        if got != want:
            missing = sorted(set(want) ^ set(got))
            if missing:
                raise ArchitectureMismatch(f"model {i} and model 0 differ in their weights: "
                                           f"{', '.join(missing[:5])}")
            name = next(k for k in want if want[k] != got[k])
            raise ArchitectureMismatch(f"model {i}'s {name} is {_describe(got[name])}, "
                                       f"model 0's {_describe(want[name])}")
        if model.training != first.training:
            mode = {True: "training", False: "eval"}
            raise ArchitectureMismatch(f"model {i} is in {mode[model.training]} mode, model 0 "
                                       f"in {mode[first.training]} mode")


def _describe(signature: tuple) -> str:
    shape, dtype, is_parameter = signature
    return f"{list(shape)} {dtype}" + ("" if is_parameter else " (a buffer)")


def _signature(model: nn.Module) -> dict[str, tuple]:
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return {k: (tuple(v.shape), v.dtype, isinstance(v, nn.Parameter)) for k, v in state.items()}


class HorizontalArray(nn.Module):
    """N instances of one architecture as one module (see the module docstring). Its
    parameters are the instances' parameters stacked, `[N, *shape]`; it is called with
    every input stacked the same way (`in_dims=0`), or shared by all instances where
    `shared` says so."""

    def __init__(self, models: Sequence[nn.Module], shared: Sequence[bool] | None = None):
        super().__init__()
        check_same_architecture(models)
        self.size = len(models)
        self.shared = tuple(shared) if shared is not None else None
        params, buffers = stack_module_state(list(models))
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        self.stacked = nn.ParameterList(
            [nn.Parameter(params[k].detach().clone(), requires_grad=params[k].requires_grad)
             for k in self._param_names])
        for i, k in enumerate(self._buffer_names):
            self.register_buffer(f"stacked_buffer_{i}", buffers[k].detach().clone())
        # the architecture without weights: not a submodule, so it holds no state here
        object.__setattr__(self, "_template", copy.deepcopy(models[0]).to("meta"))
        self.train(models[0].training)

    def _state(self) -> tuple[dict, dict]:
        params = dict(zip(self._param_names, self.stacked))
        buffers = {k: getattr(self, f"stacked_buffer_{i}") for i, k in enumerate(self._buffer_names)}
        return params, buffers

    def forward(self, *inputs):
        shared = self.shared or (False,) * len(inputs)
        if len(shared) != len(inputs):
            raise ArchitectureMismatch(f"{len(inputs)} inputs given, `shared` describes "
                                       f"{len(shared)}")
        for i, (x, is_shared) in enumerate(zip(inputs, shared)):
            if not is_shared and (not isinstance(x, torch.Tensor) or x.dim() == 0
                                  or x.shape[0] != self.size):
                raise ArchitectureMismatch(
                    f"input {i} must be stacked per instance, [{self.size}, ...]; got "
                    f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        params, buffers = self._state()
        template = self._template
        template.train(self.training)

        def one(p, b, *xs):
            return functional_call(template, (p, b), xs)

        dims = (0, 0) + tuple(None if s else 0 for s in shared)
        return vmap(one, in_dims=dims, randomness="different")(params, buffers, *inputs)

    def instance(self, index: int) -> nn.Module:
        """Instance `index` as a module of its own, with its current weights."""
        if not 0 <= index < self.size:
            raise IndexError(f"instance {index} of {self.size}")
        model = copy.deepcopy(self._template).to_empty(device="cpu")
        params, buffers = self._state()
        # every tensor by name, non-persistent buffers too (a state dict leaves them out,
        # and to_empty left them uninitialized)
        targets = dict(model.named_parameters())
        targets.update(model.named_buffers())
        with torch.no_grad():
            for name, stacked in {**params, **buffers}.items():
                targets[name].copy_(stacked[index])
        return model.train(self.training)


def horizontal(models: Sequence[nn.Module], shared: Sequence[bool] | None = None) -> HorizontalArray:
    """`models` (one architecture, each its own weights) fused into one module; see
    `HorizontalArray`. The models themselves are left as they are."""
    return HorizontalArray(models, shared)
