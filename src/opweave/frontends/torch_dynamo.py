"""`torch.compile(model, backend="opweave")`: Dynamo captures, AOTAutograd lowers to ATen
(forward and, for training, backward graphs), opweave compiles each graph it is handed.

Registered under the `torch_dynamo_backends` entry point, so it works without
`import opweave`.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from ..options import Options
from .decompositions import decomposition_table
from .program import CompiledProgram

_counter = itertools.count()


def _compile_aten_graph(gm: torch.fx.GraphModule, example_inputs, options: Options):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # AOTAutograd calls compilers under its fake mode
        program = CompiledProgram(gm, name=f"dynamo_{next(_counter)}", options=options)
    program.warn_fallbacks()
    compiled_graphs.append(program)

    def run(args: list):  # AOTAutograd's boxed convention: one list of arguments
        return program(*args)

    run._boxed_call = True
    return run


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


def opweave_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The Dynamo backend: `backend(graph_module, example_inputs) -> callable`.
    Options (`torch.compile(..., options={...})`): `rewrite` and `fusion` (see
    `opweave.compile`)."""
    from torch._dynamo.backends.common import aot_autograd

    unknown = set(options) - {"rewrite", "fusion"}
    if unknown:
        raise ValueError(f"unknown opweave backend option(s) {sorted(unknown)}; known: rewrite, fusion")
    resolved = Options.resolve(rewrite=options.get("rewrite"), fusion=options.get("fusion"))
    compiler = functools.partial(_compile_aten_graph, options=resolved)
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           decompositions=decomposition_table())
    return backend(gm, example_inputs)
