"""`torch.compile(model, backend="opweave")`: Dynamo captures, AOTAutograd lowers to ATen
(forward and, for training, backward graphs), opweave compiles each graph it is handed.

Registered under the `torch_dynamo_backends` entry point, so it works without
`import opweave`.
"""
from __future__ import annotations

import functools
import itertools

import torch

from .decompositions import decomposition_table
from .program import CompiledProgram

_counter = itertools.count()


def _compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, rewrite=None, fusion=None):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # AOTAutograd calls compilers under its fake mode
        program = CompiledProgram(gm, name=f"dynamo_{next(_counter)}", rewrite=rewrite, fusion=fusion)
    program.warn_fallbacks()
    compiled_graphs.append(program)

    def run(args: list):  # AOTAutograd's boxed convention: one list of arguments
        return program(*args)

    run._boxed_call = True
    return run


# The programs compiled in this process, newest last (for explain and tests).
compiled_graphs: list[CompiledProgram] = []


def opweave_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: `backend(graph_module, example_inputs) -> callable`.
    Options (`torch.compile(..., options={...})`): `rewrite` and `fusion` (see
    `opweave.compile`)."""
    from torch._dynamo.backends.common import aot_autograd

    unknown = set(options) - {"rewrite", "fusion"}
    if unknown:
        raise ValueError(f"unknown opweave backend option(s) {sorted(unknown)}; known: rewrite, fusion")
    compiler = functools.partial(_compile_aten_graph, rewrite=options.get("rewrite"),
                                 fusion=options.get("fusion"))
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           decompositions=decomposition_table())
    return backend(gm, example_inputs)
