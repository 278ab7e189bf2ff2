"""`torch.compile(model, backend="opweave")`: Dynamo captures, AOTAutograd lowers to ATen
(forward and, for training, backward graphs), opweave compiles each graph it is handed.

A graph that runs without autograd (`torch.no_grad()`, `torch.inference_mode()`, or nothing
requires grad) is AOTAutograd's inference graph: its parameters and buffers are frozen as
constants, as `opweave.compile` freezes them, behind a per-call check that they have not
changed (frontends/freezing.py). Dynamo guards on grad mode, so enabling grad later
recompiles through the training path.

Registered under the `torch_dynamo_backends` entry point, so it works without
`import opweave`.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from ..notices import OpweaveFallbackWarning, warn_once
from ..options import Options
from .decompositions import decomposition_table, ops_kept_whole
from .freezing import FrozenProgram, freezable_positions
from .program import CompiledProgram
from .training import float32_training

_counter = itertools.count()


def _build_program(gm: torch.fx.GraphModule, constants, name: str,
                   options: Options) -> CompiledProgram:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # AOTAutograd calls compilers under its fake mode
        program = CompiledProgram(gm, constants, name=name, options=options)
    program.warn_fallbacks()
    compiled_graphs.append(program)
    return program


def _compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, options: Options):
    program = _build_program(gm, {}, f"dynamo_{next(_counter)}", options)

    def run(args: list):  # AOTAutograd's boxed convention: one list of arguments
        return program(*args)

    run._boxed_call = True
    return run


def _training_compiler(options: Options):
    def compile_training_graph(gm, example_inputs):
        return _compile_aten_graph(gm, example_inputs, float32_training(options))
    return compile_training_graph


def _compile_inference_graph(gm: torch.fx.GraphModule, example_inputs, *, dynamo_gm,
                             dynamo_inputs, options: Options):
    """AOTAutograd's inference compiler: freeze the parameters and buffers it can."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    positions = freezable_positions(gm, dynamo_gm, dynamo_inputs)
    if not positions:
        return _compile_aten_graph(gm, example_inputs, options)
    build = functools.partial(_build_program, options=options)
    with unset_fake_temporarily():
        program = FrozenProgram(gm, positions, dynamo_inputs, build, f"dynamo_{next(_counter)}")
    frozen_programs.append(program)
    return program


class _Recent:
    """The programs compiled in this process (for explain, the bench and tests), held
    weakly: a program (and the weights it holds) goes when Dynamo drops its code.
    `mark()` before compiling and `since(mark)` after give the programs made in between."""

    def __init__(self):
        self._refs: list[tuple[int, weakref.ref]] = []
        self._next = 0

    def append(self, program: CompiledProgram) -> None:
        self._refs = [(i, r) for i, r in self._refs if r() is not None]
        self._refs.append((self._next, weakref.ref(program)))
        self._next += 1

    def mark(self) -> int:
        return self._next

    def since(self, mark: int) -> list[CompiledProgram]:
        return [p for i, r in self._refs if i >= mark for p in [r()] if p is not None]

    def __iter__(self):
        return iter(self.since(0))

    def __len__(self) -> int:
        return len(self.since(0))

    def clear(self) -> None:
        self._refs.clear()


compiled_graphs = _Recent()
# The inference graphs compiled with frozen weights (a rebuilt plan's program is in
# compiled_graphs too).
frozen_programs = _Recent()


def opweave_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: `backend(graph_module, example_inputs) -> callable`.
    Options (`torch.compile(..., options={...})`): `rewrite`, `fusion` and `precision`
    (see `opweave.compile`; precision applies to inference graphs), `freeze` (default
    True: freeze weights in inference graphs)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.exc import TorchDynamoException

    # torch.compile passes its `options` dict as one keyword argument named `options`
    options = {**(options.pop("options", None) or {}), **options}
    unknown = set(options) - {"rewrite", "fusion", "freeze", "precision", "schedule"}
    if unknown:
        raise ValueError(f"unknown opweave backend option(s) {sorted(unknown)}; "
                         "known: rewrite, fusion, freeze, precision, schedule")
    resolved = Options.resolve(rewrite=options.get("rewrite"), fusion=options.get("fusion"),
                               precision=options.get("precision"),
                               schedule=options.get("schedule"))
    inference = functools.partial(_compile_aten_graph, options=resolved)
    # the forward and backward of a training step (built only when one is run)
    compiler = _training_compiler(resolved)
    if options.get("freeze", True):
        inference = functools.partial(_compile_inference_graph, dynamo_gm=gm,
                                      dynamo_inputs=list(example_inputs), options=resolved)
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           inference_compiler=inference, decompositions=decomposition_table())
    try:
        with ops_kept_whole():
            return backend(gm, example_inputs)
    except TorchDynamoException:
        raise  # Dynamo's own signals (restart the analysis, ...) are for Dynamo
    except Exception as err:  # noqa: BLE001  (a graph it cannot take runs, in eager)
        # AOTAutograd traces the graph again, with the ops opweave keeps whole: a meta
        # function can fail where eager runs (torch 2.13's upsample_nearest2d on an empty
        # batch raises TypeError), and no failure to compile may stop the user's program
        why = (str(err).splitlines() or [""])[0][:200]
        warn_once(f"opweave: torch.compile's graph of {len(gm.graph.nodes)} nodes could not "
                  f"be compiled ({type(err).__name__}: {why}); it runs in eager PyTorch",
                  OpweaveFallbackWarning)
        return gm.forward
