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

import torch

from .decompositions import decomposition_table
from .freezing import FrozenProgram, freezable_positions
from .program import CompiledProgram

_counter = itertools.count()


def _build_program(gm: torch.fx.GraphModule, constants, name: str, rewrite=None,
                   fusion=None) -> CompiledProgram:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # AOTAutograd calls compilers under its fake mode
        program = CompiledProgram(gm, constants, name=name, rewrite=rewrite, fusion=fusion)
    program.warn_fallbacks()
    compiled_graphs.append(program)
    return program


def _compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, rewrite=None, fusion=None):
    program = _build_program(gm, {}, f"dynamo_{next(_counter)}", rewrite, fusion)

    def run(args: list):  # AOTAutograd's boxed convention: one list of arguments
        return program(*args)

    run._boxed_call = True
    return run


def _compile_inference_graph(gm: torch.fx.GraphModule, example_inputs, *, dynamo_gm,
                             dynamo_inputs, rewrite=None, fusion=None):
    """AOTAutograd's inference compiler: freeze the parameters and buffers it can."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    positions = freezable_positions(gm, dynamo_gm, dynamo_inputs)
    if not positions:
        return _compile_aten_graph(gm, example_inputs, rewrite=rewrite, fusion=fusion)
    build = functools.partial(_build_program, rewrite=rewrite, fusion=fusion)
    with unset_fake_temporarily():
        program = FrozenProgram(gm, positions, dynamo_inputs, build, f"dynamo_{next(_counter)}")
    frozen_programs.append(program)
    return program


# The programs compiled in this process, newest last (for explain and tests); a rebuilt
# frozen plan is appended too.
compiled_graphs: list[CompiledProgram] = []
# The inference graphs compiled with frozen weights, newest last.
frozen_programs: list[FrozenProgram] = []


def opweave_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: `backend(graph_module, example_inputs) -> callable`.
    Options (`torch.compile(..., options={...})`): `rewrite` and `fusion` (see
    `opweave.compile`), `freeze` (default True: freeze weights in inference graphs)."""
    from torch._dynamo.backends.common import aot_autograd

    # torch.compile passes its `options` dict as one keyword argument named `options`
    options = {**(options.pop("options", None) or {}), **options}
    unknown = set(options) - {"rewrite", "fusion", "freeze"}
    if unknown:
        raise ValueError(f"unknown opweave backend option(s) {sorted(unknown)}; "
                         "known: rewrite, fusion, freeze")
    passes = {"rewrite": options.get("rewrite"), "fusion": options.get("fusion")}
    compiler = functools.partial(_compile_aten_graph, **passes)
    inference = compiler
    if options.get("freeze", True):
        inference = functools.partial(_compile_inference_graph, dynamo_gm=gm,
                                      dynamo_inputs=list(example_inputs), **passes)
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           inference_compiler=inference, decompositions=decomposition_table())
    return backend(gm, example_inputs)
