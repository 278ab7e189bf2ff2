"""`opweave.compile(model, example_inputs)`: capture with torch.export, compile, run.

Parameters and buffers are frozen into the graph as constants (this path is for
inference). Where torch.export cannot capture the model, opweave traces it with make_fx
(tensors the model holds, such as a sparse adjacency, become constants); where that fails
too, the model runs in eager PyTorch and opweave says so once.
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..options import Options
from .decompositions import decomposition_table
from .program import CompiledProgram, Coverage, OpweaveFallbackWarning


class CompiledModel:
    """A model compiled by opweave; call it like the original module."""

    def __init__(self, model: torch.nn.Module, program: CompiledProgram | None,
                 capture: str, out_spec=None, capture_error: str = "", in_spec=None):
        self.model = model
        self._in_spec = in_spec  # how the example inputs flatten
        self.program = program
        self.capture = capture  # "export", "make_fx" or "eager"
        self.capture_error = capture_error
        self._out_spec = out_spec

    @property
    def coverage(self) -> Coverage:
        return self.program.coverage if self.program else Coverage()

    @property
    def graphs(self):
        return self.program.graphs if self.program else []

    def __call__(self, *args, **kwargs):
        if self.program is None:
            return self.model(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            self._structure_error(args, kwargs, spec)
        outputs = self.program(*flat)
        if self._out_spec is None:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return pytree.tree_unflatten(list(outputs), self._out_spec)

    def _structure_error(self, args, kwargs, spec) -> None:
        """Arguments that do not flatten like the example inputs: the compiled graph would
        bind the wrong values to its inputs (or too few) without this check."""
        from ..runtime import InputError

        expected = self._in_spec.children_specs[0].num_children
        if kwargs or len(args) != expected:
            got = f"{len(args)}" + (f" and keywords {sorted(kwargs)}" if kwargs else "")
            raise InputError(f"{self.program.name} was compiled for {expected} positional "
                             f"input(s), got {got}")
        for i, (arg, want) in enumerate(zip(args, self._in_spec.children_specs[0].children_specs)):
            have = pytree.tree_flatten(arg)[1]
            if have != want:
                raise InputError(f"input {i} of {self.program.name} is {_describe(have)}, "
                                 f"expected {_describe(want)} as in the example inputs")


def _describe(spec) -> str:
    if spec.is_leaf():
        return "a single tensor"
    return f"a {getattr(spec.type, '__name__', spec.type)} of {spec.num_children} item(s)"


def _capture_export(model, example_inputs):
    exported = torch.export.export(model, tuple(example_inputs))
    exported = exported.run_decompositions(decomposition_table())
    gm = exported.graph_module
    sig = exported.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise RuntimeError("the model mutates its buffers or inputs (training mode?); "
                           "opweave.compile freezes weights for inference")
    state = {**exported.state_dict, **exported.constants}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    constants: dict[fx.Node, torch.Tensor] = {}
    for spec in sig.input_specs:
        target = getattr(spec, "target", None)
        if target is not None and target in state:
            constants[placeholders[spec.arg.name]] = state[target]
    return gm, constants, exported.call_spec.out_spec


def _capture_make_fx(model, example_inputs):
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        gm = make_fx(lambda *a: model(*a), decomposition_table=decomposition_table())(*example_inputs)
    return gm, {}, None


def compile(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
            name: str | None = None, rewrite=None, fusion=None, train: bool = False,
            loss_every: int | None = 1, options: Options | None = None):
    """Compile `model` for inference on inputs shaped like `example_inputs`. `options`:
    an `opweave.Options` (default: from the environment); `rewrite` and `fusion`
    override its fields. With `train=True`, `model(*inputs)` must return a scalar loss;
    see `training`."""
    name = name or type(model).__name__
    options = Options.resolve(options, rewrite=rewrite, fusion=fusion)
    if train:
        from .training import TrainingModel

        return TrainingModel(model, example_inputs, name=name, options=options,
                             loss_every=loss_every)
    errors = []
    for capture, fn in (("export", _capture_export), ("make_fx", _capture_make_fx)):
        try:
            gm, constants, out_spec = fn(model, example_inputs)
        except Exception as err:  # capture failures are reported, never fatal
            errors.append(f"{capture}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        program = CompiledProgram(gm, constants, name=name, options=options)
        program.warn_fallbacks()
        if errors:
            warnings.warn(f"opweave captured {name} with {capture} after " + "; ".join(errors),
                          OpweaveFallbackWarning, stacklevel=2)
        in_spec = pytree.tree_flatten((tuple(example_inputs), {}))[1]
        return CompiledModel(model, program, capture, out_spec, "; ".join(errors), in_spec)
    message = f"opweave could not capture {name}; it runs in eager PyTorch ({'; '.join(errors)})"
    warnings.warn(message, OpweaveFallbackWarning, stacklevel=2)
    return CompiledModel(model, None, "eager", capture_error="; ".join(errors))
