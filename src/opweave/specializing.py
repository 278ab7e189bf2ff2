"""A graph compiled for many shapes: one symbolic graph, one plan per binding.

A frontend captures and lowers a model once, with symbolic sizes (ir.symbols). The graph
passes (rewrite, GEMM layout) then run once on the symbolic graph, costed at the first
call's sizes; lowering (fusion, kernels, library calls, memory plan) runs on concrete
sizes, once for each distinct binding of the symbols a call brings (`ir.specialize`),
and each plan is kept for the next call with the same sizes, least recently used dropped
beyond MAX_SPECIALIZATIONS. Library forms are measured once per size class, not per
size (`codegen.choice.by_size_class`). Specializing rebuilds every node on the real
sizes and checks it against the symbolic type, so a binding the symbolic graph does not
hold for raises SymbolError, never runs a wrong plan. The plans share the constants
compiling derives from the weights (folded, transposed, packed: `shared_constants`), so
each new size costs its kernels and buffers, not another copy of the weights.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Mapping, Sequence

from . import cost, shared_constants
from .codegen import choice
from .ir import Graph, symbols
from .ir.specialize import binding_of, graph_symbols, specialize
from .ir.symbols import SymbolError
from .options import Options
from .passes.fold import fold_constants
from .pipeline import (CompiledGraph, PassReport, PreparedGraph, compile_graph, lower_prepared,
                       prepare_graph)
from .runtime.memory_plan import symbolic_peak

# Plans kept per symbolic graph: BERT served at 8 sequence lengths and 4 batch sizes is 32.
MAX_SPECIALIZATIONS = 32


class SymbolicGraph:
    """Callable like an Executor: `family(*tensors, given=None)`; `given` holds the values
    of the symbols the graph's inputs do not carry (`Graph.symbols`)."""

    def __init__(self, graph: Graph, options: Options):
        self.graph = graph
        self.options = options
        self.symbols = graph_symbols(graph)
        self.compiles = 0  # specializations compiled so far (evicted ones included)
        self.latest: CompiledGraph | None = None
        self._plans: OrderedDict[tuple, CompiledGraph] = OrderedDict()
        self._by_call: dict[tuple, tuple[tuple, CompiledGraph]] = {}  # sizes -> (binding, plan)
        self._sharing = shared_constants.new_scope()  # plans share packed/folded weights
        self._peak = None  # symbolic_peak of the graph, computed when first asked
        self._prepared: PreparedGraph | None = None  # after the graph passes, symbolic
        self.per_binding: str | None = None  # why the passes could not run symbolically

    def compiled_for(self, shapes: Sequence[Sequence[int]],
                     given: Mapping[str, int] | None = None) -> CompiledGraph:
        given = {k: v for k, v in (given or {}).items() if k in self.graph.symbols}
        # the call's sizes decide its binding: look them up before solving for it (sympy
        # costs tens of microseconds a dimension, more than a small plan's whole call)
        call = (tuple(tuple(s) for s in shapes), tuple(sorted(given.items())))
        known = self._by_call.get(call)
        if known is not None:
            self._plans.move_to_end(known[0])
            self.latest = known[1]
            return known[1]
        binding = binding_of(self.graph, shapes, given)
        key = tuple(sorted(binding.items()))
        plan = self._plans.get(key)
        if plan is None:
            with shared_constants.sharing(self._sharing), choice.by_size_class():
                plan = self._compile(binding)
            self.compiles += 1
            self._plans[key] = plan
            if len(self._plans) > MAX_SPECIALIZATIONS:
                self._plans.popitem(last=False)
                self._by_call.clear()  # drop lookups of the evicted plan
        else:
            self._plans.move_to_end(key)
        self._by_call[call] = (key, plan)
        self.latest = plan
        return plan

    def _compile(self, binding: dict[str, int]) -> CompiledGraph:
        """The plan for `binding`: the graph passes ran once on the symbolic graph (costed
        at the first binding), so a new size costs specializing and lowering only; where
        they cannot run symbolically, every pass runs on the specialized graph."""
        if self._prepared is None and self.per_binding is None:
            try:
                with cost.at_sizes(binding):
                    self._prepared = prepare_graph(self.graph, self.options, strict=True)
            except Exception as err:  # noqa: BLE001  (the per-binding pipeline still works)
                self.per_binding = f"{type(err).__name__}: {err}"
        if self._prepared is not None:
            start = time.perf_counter()
            try:
                concrete = specialize(self._prepared.graph, binding)
            except SymbolError:
                pass  # the original decides below: a SymbolError, or every pass per binding
            else:
                # what the sizes made constant (embeddings of the sequence's positions)
                folded, count = fold_constants(concrete)
                report = PassReport("fold", time.perf_counter() - start, len(concrete.nodes),
                                    len(folded.nodes), f"{count} node(s) constant at these sizes")
                plan = lower_prepared(self._prepared, folded)
                plan.reports.insert(len(self._prepared.reports), report)
                return plan
        return compile_graph(specialize(self.graph, binding), self.options)

    def __call__(self, *tensors, given: Mapping[str, int] | None = None):
        return self.compiled_for([t.shape for t in tensors], given)(*tensors)

    @property
    def plans(self) -> list[CompiledGraph]:
        return list(self._plans.values())

    @property
    def bindings(self) -> list[dict[str, int]]:
        """The sizes of the plans kept, least recently used first."""
        return [dict(key) for key in self._plans]

    def peak_bytes(self, binding: Mapping[str, int] | None = None):
        """The peak bytes of intermediates when the graph runs node by node, as a formula
        over the symbols (or its value at `binding`): a bound before fusion, for sizes no
        plan was compiled for yet. A compiled plan's own peak is its memory plan's."""
        if self._peak is None:
            self._peak = symbolic_peak(self.graph)
        return self._peak if binding is None else symbols.substitute(self._peak, binding)

    def describe(self) -> str:
        """For explain: the symbols, the plans kept and the peak formula."""
        kept = ", ".join(" ".join(f"{k}={v}" for k, v in sorted(b.items()))
                         for b in self.bindings) or "none yet"
        passes = ("graph passes once, over the symbols" if self.per_binding is None
                  else f"graph passes per size ({self.per_binding})")
        return (f"dynamic over {', '.join(sorted(self.symbols))}: {self.compiles} plan(s) "
                f"compiled, kept for {kept}; {passes}; peak before fusion "
                f"{self.peak_bytes()} bytes")

    def __repr__(self) -> str:
        return (f"SymbolicGraph({self.graph.name}, symbols {sorted(self.symbols)}, "
                f"{len(self._plans)} plan(s) kept, {self.compiles} compiled)")
