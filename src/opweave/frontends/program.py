"""Compile an ATen-level FX graph: lower what the IR supports, run the rest in eager.

The FX nodes are classified (supported or not, with the reason), reordered so supported
nodes cluster, and cut into contiguous segments. Each supported segment becomes one IR
graph run by the executor; each unsupported node runs as the ATen call it was. Because
segments are contiguous in a topological order, the split can never create a cycle.
"""
from __future__ import annotations

import heapq
import operator
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..ir import Graph, ShapeError
from ..ir.graph import Value
from ..notices import OpweaveFallbackWarning, warn_once
from ..options import Options
from ..pipeline import CompiledGraph, compile_graph
from ..runtime import Executor
from . import aten  # noqa: F401  (fills the lowering table)
from ..ir import symbols
from ..ir.specialize import is_symbolic
from ..specializing import SymbolicGraph
from .lowering import (TABLE, LoweringContext, Unsupported, fx_value, is_size, tensor_type,
                       with_sizes)


@dataclass
class Coverage:
    """What share of a graph opweave runs, and what falls back (op -> count, op -> reason)."""

    supported: Counter = field(default_factory=Counter)
    fallback: Counter = field(default_factory=Counter)
    reasons: dict[str, str] = field(default_factory=dict)
    segments: int = 0
    ir_nodes: int = 0

    @property
    def total(self) -> int:
        return sum(self.supported.values()) + sum(self.fallback.values())

    @property
    def share(self) -> float:
        return sum(self.supported.values()) / self.total if self.total else 1.0

    def fallback_message(self) -> str:
        listed = ", ".join(f"{op} x{n} ({self.reasons.get(op, '')})" for op, n in
                           self.fallback.most_common())
        return f"opweave runs these ops in eager PyTorch: {listed}"


def op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) if target is operator.getitem else str(target)


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function"


def _size_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes that compute sizes from the inputs' sizes (`s0 * s1`, `sym_size(x, 1)`)
    under dynamic shapes. They run first, in Python; a lowered node reads the symbolic
    dimension each stands for instead (`lowering.with_sizes`)."""
    found: list[fx.Node] = []
    for node in graph.nodes:
        if _is_compute(node) and is_size(node) and all(
                d.op == "placeholder" or d in found for d in node.all_input_nodes):
            found.append(node)
    return found


def _sizes_read(sizes: list[fx.Node], supported: set[fx.Node]) -> set[fx.Node]:
    """The size nodes whose values an eager step or the output reads. Lowered nodes read
    the symbols the call binds instead, so the others need not run."""
    read: set[fx.Node] = set()
    for node in reversed(sizes):
        if any(user in read or (user not in supported and user not in sizes)
               for user in node.users):
            read.add(node)
    return read


def _trial_lower(node: fx.Node, constants) -> tuple[Any, str]:
    """Lower one node into a scratch graph; return (its values, '') or (None, reason)."""
    rule = TABLE.get(node.target)
    if rule is None:
        return None, "no lowering"
    scratch = LoweringContext(Graph("trial"), constants)
    try:
        for dep in node.all_input_nodes:
            if dep in constants or is_size(dep):
                continue
            example = fx_value(dep)
            if isinstance(example, (tuple, list)):
                scratch.values[dep] = [scratch.graph.add_input(f"{dep.name}_{i}", tensor_type(e))
                                       if isinstance(e, torch.Tensor) else None
                                       for i, e in enumerate(example)]
            else:
                scratch.values[dep] = scratch.graph.add_input(dep.name, tensor_type(example))
        scratch.node = node
        args, kwargs = with_sizes(node.args, node.kwargs)
        result = rule(scratch, *args, **kwargs)
        _check_against_example(node, result)
        return result, ""
    except Unsupported as err:
        return None, str(err)
    except (ShapeError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as err:
        return None, f"{type(err).__name__}: {err}"


def _check_against_example(node: fx.Node, result) -> None:
    """The lowering must produce exactly the type torch computed for this node."""
    if result is None:  # a node with no value (a static check)
        return
    example = fx_value(node)
    pairs = zip(result, example) if isinstance(result, (list, tuple)) else [(result, example)]
    for value, ex in pairs:
        if value is None or not isinstance(ex, torch.Tensor):
            continue
        want = tensor_type(ex)
        if value.type != want:
            raise Unsupported(f"lowering gives {value.type}, torch gives {want}")


@dataclass
class _Segment:
    nodes: list[fx.Node]
    compiled: CompiledGraph | None = None  # a symbolic segment: its latest plan
    executor: Executor | SymbolicGraph | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)


def _device_of(nodes) -> str:
    """The GPU a segment's example values are on ("cuda:N"), else "cpu"."""
    for node in nodes:
        example = node.meta.get("val", node.meta.get("example_value"))
        for t in example if isinstance(example, (list, tuple)) else [example]:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                return str(t.device)
    return "cpu"


class CompiledProgram:
    """The split graph, callable like the FX graph it came from."""

    def __init__(self, gm: fx.GraphModule, constants: dict[fx.Node, torch.Tensor] | None = None,
                 name: str = "graph", options: Options | None = None):
        self.gm = gm
        self.name = name
        self.options = Options.resolve(options)
        graph = gm.graph
        self.constants = dict(constants or {})
        # The runtime arguments: placeholders not bound to constants, in order.
        self.placeholders = [n for n in graph.nodes
                             if n.op == "placeholder" and n not in self.constants]
        for node in graph.nodes:
            if node.op == "get_attr":
                self.constants[node] = _fetch_attr(gm, node.target)
        _fold_sparse_views(graph, self.constants)
        self.coverage = Coverage()
        sizes = _size_nodes(graph)
        self._symbol_sources = _symbol_sources(self.placeholders)
        supported, reasons = self._classify(graph, set(sizes))
        order = _cluster_order(graph, supported, self.constants, sizes)
        unread = set(sizes) - _sizes_read(sizes, supported)
        self.steps: list[_Segment | fx.Node] = []
        for node in order:
            if node in unread:
                continue
            if node in supported:
                if not self.steps or not isinstance(self.steps[-1], _Segment):
                    self.steps.append(_Segment([]))
                self.steps[-1].nodes.append(node)
            else:
                self.steps.append(node)
                if node.target is not operator.getitem and node not in sizes:  # not ops
                    name_ = op_name(node)
                    self.coverage.fallback[name_] += 1
                    self.coverage.reasons.setdefault(name_, reasons.get(node, ""))
        self.output_node = next(n for n in graph.nodes if n.op == "output")
        self._build_segments()
        self._plan_frees()
        self._dense = self._dense_values()
        self._calls = self._make_calls()
        self._direct = self._direct_plan()

    # -- classification ------------------------------------------------------------------
    def _classify(self, graph: fx.Graph, sizes: set[fx.Node]):
        supported: set[fx.Node] = set()
        reasons: dict[fx.Node, str] = {}
        trial: dict[fx.Node, Any] = {}
        for node in graph.nodes:
            if not _is_compute(node) or node in self.constants or node in sizes:
                continue
            if node.target is operator.getitem:
                source = node.args[0]
                # An unused getitem of an output that is not computed (None) is harmless.
                ok = source in supported and trial.get(source) is not None \
                    and isinstance(trial[source], (list, tuple)) \
                    and (trial[source][node.args[1]] is not None or not node.users)
                if ok:
                    supported.add(node)
                else:
                    reasons[node] = "its source runs in eager"
                continue
            result, reason = _trial_lower(node, self.constants)
            if reason:
                reasons[node] = reason
            else:
                supported.add(node)
                trial[node] = result
                self.coverage.supported[op_name(node)] += 1
        return supported, reasons

    # -- segments --------------------------------------------------------------------------
    def _build_segments(self) -> None:
        position = {}
        for i, step in enumerate(self.steps):
            for node in (step.nodes if isinstance(step, _Segment) else [step]):
                position[node] = i
        for i, step in enumerate(self.steps):
            if not isinstance(step, _Segment):
                continue
            members = set(step.nodes)
            step.inputs = list(dict.fromkeys(
                dep for n in step.nodes for dep in n.all_input_nodes
                if dep not in members and dep not in self.constants and not is_size(dep)))
            step.outputs = [n for n in step.nodes
                            if any(u not in members for u in n.users)]
            graph = self._lower_segment(step, f"{self.name}_{i}")
            options = self.options
            if options.device is None:  # where its tensors are (a model may move them)
                options = replace(options, device=_device_of(step.nodes + step.inputs))
            if is_symbolic(graph) or graph.symbols:
                step.executor = SymbolicGraph(graph, options)
            else:
                step.compiled = compile_graph(graph, options)
                step.executor = step.compiled.executor
            self.coverage.segments += 1
            self.coverage.ir_nodes += len(step.executor.graph.nodes)

    def _lower_segment(self, segment: _Segment, name: str) -> Graph:
        """The segment's FX nodes as one IR graph (the pipeline does the rest)."""
        ctx = LoweringContext(Graph(name), self.constants)
        for dep in segment.inputs:
            ctx.values[dep] = ctx.graph.add_input(dep.name, tensor_type(fx_value(dep)))
        for node in segment.nodes:
            ctx.node = node
            args, kwargs = with_sizes(node.args, node.kwargs)
            ctx.values[node] = TABLE[node.target](ctx, *args, **kwargs)
        outputs = []
        for node in segment.outputs:
            value = ctx.values[node]
            if not isinstance(value, Value):
                raise AssertionError(f"segment output {node.name} is not a single tensor")
            outputs.append(value)
        ctx.graph.outputs = outputs
        ctx.graph.remove_dead()
        graph = ctx.graph
        carried = symbols.free_symbols(d for v in graph.inputs for d in v.type.shape)
        used = symbols.free_symbols([v.type.shape for n in graph.nodes for v in n.outputs]
                                    + [a for n in graph.nodes for a in n.attrs.values()])
        graph.symbols = sorted(used - carried)  # bound from the program's size arguments
        return graph

    def _dense_values(self) -> set[fx.Node]:
        """The values eager steps read that torch traced as contiguous tensors. A segment
        may produce them in another layout (a library form's output as a transposed view),
        and some ATen kernels refuse non-contiguous inputs (native_group_norm)."""
        dense = set()
        for step in self.steps:
            if isinstance(step, _Segment):
                continue
            for dep in step.all_input_nodes:
                example = dep.meta.get("val")
                if isinstance(example, torch.Tensor) and example.layout == torch.strided \
                        and example.is_contiguous():
                    dense.add(dep)
        return dense

    def _plan_frees(self) -> None:
        """After each step, which FX values nobody later needs (dropped to free memory)."""
        slot = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        self._slot = slot
        # constants bound once; the last slot holds the call's symbol values
        self._base_env: list[Any] = [None] * (len(slot) + 1)
        self._binding_slot = len(slot)
        for node, value in self.constants.items():
            self._base_env[slot[node]] = value
        last: dict[fx.Node, int] = {}
        for i, step in enumerate(self.steps):
            used = step.inputs if isinstance(step, _Segment) else step.all_input_nodes
            for dep in used:
                last[dep] = i
        keep = set(self.output_node.all_input_nodes)
        self._frees = [[] for _ in self.steps]
        for node, i in last.items():
            if node not in keep and node not in self.constants:
                self._frees[i].append(slot[node])

    # -- running ---------------------------------------------------------------------------
    def _make_calls(self) -> list[Callable[[list], None]]:
        """One function per step, reading its arguments from and writing its results to
        the call's value list."""
        slot, dense = self._slot, self._dense
        calls = []
        for step in self.steps:
            if isinstance(step, _Segment):
                ins = [slot[n] for n in step.inputs]
                outs = [slot[n] for n in step.outputs]

                def segment(env, step=step, ins=ins, outs=outs):
                    results = step.executor(*[env[i] for i in ins])
                    for s, value in zip(outs, results):
                        env[s] = value

                def symbolic_segment(env, step=step, ins=ins, outs=outs, at=self._binding_slot):
                    results = step.executor(*[env[i] for i in ins], given=env[at])
                    step.compiled = step.executor.latest
                    for s, value in zip(outs, results):
                        env[s] = value
                if isinstance(step.executor, SymbolicGraph):
                    segment = symbolic_segment
                calls.append(segment)
            else:
                def eager(env, node=step):
                    def read(n):
                        return _read(env[slot[n]], n, dense)
                    env[slot[node]] = node.target(*fx.node.map_arg(node.args, read),
                                                  **fx.node.map_arg(node.kwargs, read))
                calls.append(eager)
        return calls

    def _direct_plan(self) -> tuple[Executor, list[int] | None, list[int]] | None:
        """(the executor, which argument is each of its inputs (None: in order), which of
        its results is each output) where the whole program is one static segment that
        reads every argument and makes every output: a call can then go straight to its
        native plan (`replay`). None where eager steps, several segments, symbols or
        passed-through values need the steps."""
        if len(self.steps) != 1 or not isinstance(self.steps[0], _Segment) \
                or self._symbol_sources:
            return None
        segment = self.steps[0]
        if not isinstance(segment.executor, Executor) \
                or sorted(map(id, segment.inputs)) != sorted(map(id, self.placeholders)) \
                or len(set(segment.inputs)) != len(segment.inputs):
            return None
        take = [self.placeholders.index(n) for n in segment.inputs]
        position = {node: i for i, node in enumerate(segment.outputs)}
        out = self.output_node.args[0]
        if type(out) is not tuple or not all(n in position for n in out):
            return None  # (torch's graphs return a flat tuple of nodes)
        return segment.executor, None if take == sorted(take) else take, \
            [position[n] for n in out]

    def replay(self, args: Sequence) -> Any | None:
        """The program's outputs for `args` from its native plan alone, or None where it
        has no such plan (`_direct_plan`), no plan yet, or the arguments are not the kind
        the plan recorded: then `__call__` runs the steps. No Python between the call and
        the plan: a call after the model's weights went through the caches finds this
        code and its objects cold (ResNet-50 in bf16 spent 85 us in the steps' Python
        before its plan ran, against 4 us warm; Intel Xeon family 6 model 207)."""
        direct = self._direct
        if direct is None or len(args) != len(self.placeholders):
            return None
        executor, take, picks = direct
        results = executor.replay(args if take is None else [args[i] for i in take])
        if results is None:
            return None
        return tuple([results[i] for i in picks])

    def __call__(self, *args):
        outputs = self.replay(args)
        if outputs is not None:
            return outputs
        env = list(self._base_env)
        for node, value in zip(self.placeholders, args):
            env[self._slot[node]] = value
        if self._symbol_sources:
            env[self._binding_slot] = _binding(self._symbol_sources, args)
        for call, frees in zip(self._calls, self._frees):
            call(env)
            for s in frees:
                env[s] = None
        return fx.node.map_arg(self.output_node.args[0], lambda n: env[self._slot[n]])

    @contextmanager
    def instrumented(self, wrap: Callable[[int, Callable], Callable]):
        """Meanwhile, step i (a segment or an eager op, `self.steps[i]`) runs as
        `wrap(i, fn)(env)`; for the profiler. One thread at a time."""
        saved, direct = self._calls, self._direct
        self._calls = [wrap(i, call) for i, call in enumerate(saved)]
        self._direct = None  # every call through the wrapped steps
        try:
            yield
        finally:
            self._calls, self._direct = saved, direct

    @property
    def graphs(self) -> list[Graph]:
        return [s.executor.graph for s in self.steps if isinstance(s, _Segment)]

    @property
    def compiled_graphs(self) -> list[CompiledGraph]:
        """Each segment's plan (a symbolic segment's latest; none before its first call)."""
        return [s.compiled for s in self.steps if isinstance(s, _Segment) and s.compiled]

    @property
    def symbol_sources(self) -> list[tuple[str, int, int | None]]:
        """(symbol, argument, axis or None for a size argument) for each size symbol."""
        return list(self._symbol_sources)

    @property
    def symbolic_graphs(self) -> list[SymbolicGraph]:
        return [s.executor for s in self.steps if isinstance(s, _Segment)
                and isinstance(s.executor, SymbolicGraph)]

    @property
    def rewrites(self) -> list:
        """The rewrite pass's report for each segment it ran on."""
        return [r for c in self.compiled_graphs for r in [c.report("rewrite")] if r is not None]

    def warn_fallbacks(self) -> None:
        if self.coverage.fallback:
            _warn_once(self.coverage.fallback_message())


def _read(value, node: fx.Node, dense: set[fx.Node]):
    """An eager step's argument, contiguous where torch traced it contiguous."""
    if node in dense and isinstance(value, torch.Tensor) and not value.is_contiguous():
        return value.contiguous()
    return value


def _warn_once(message: str) -> None:
    warn_once(message, OpweaveFallbackWarning, stacklevel=4)


def _fetch_attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_SPARSE_VIEWS = {torch.ops.aten.permute.default, torch.ops.aten.t.default,
                 torch.ops.aten.transpose.int}


def _fold_sparse_views(graph: fx.Graph, constants: dict[fx.Node, Any]) -> None:
    """Transposes of constant sparse tensors (the backward of a sparse matmul reads its
    adjacency transposed) become constants themselves: the IR takes sparse operands
    only as constants."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _SPARSE_VIEWS:
            continue
        source = node.args[0]
        value = constants.get(source)
        if isinstance(value, torch.Tensor) and value.layout == torch.sparse_coo:
            constants[node] = node.target(value, *node.args[1:]).coalesce()


def _symbol_sources(placeholders: list[fx.Node]) -> list[tuple[str, int, int | None]]:
    """Where a call's arguments give each symbol: (name, argument, axis), axis None for
    a size argument; empty for a graph without symbols."""
    sources, seen = [], set()
    for i, node in enumerate(placeholders):
        value = node.meta.get("val")
        dims = [(None, value)] if isinstance(value, torch.SymInt) else \
            list(enumerate(value.shape)) if isinstance(value, torch.Tensor) else []
        for axis, d in dims:
            d = symbols.dim(d) if isinstance(d, torch.SymInt) else d
            if symbols.is_symbolic(d) and d.is_Symbol and d.name not in seen:
                seen.add(d.name)
                sources.append((d.name, i, axis))
    return sources


def _binding(sources, args) -> dict[str, int]:
    return {name: int(args[i] if axis is None else args[i].shape[axis])
            for name, i, axis in sources}


def _cluster_order(graph: fx.Graph, supported: set[fx.Node], constants: dict[fx.Node, Any],
                   sizes: list[fx.Node] = ()) -> list[fx.Node]:
    """A topological order of the compute nodes that keeps supported nodes together:
    while any supported node is ready, take it; otherwise take an unsupported one. Size
    nodes come first (they read only the inputs)."""
    first = list(sizes)
    compute = [n for n in graph.nodes if _is_compute(n) and n not in constants and n not in first]
    index = {n: i for i, n in enumerate(compute)}
    pending = {n: sum(1 for d in n.all_input_nodes if d in index) for n in compute}
    ready_ok: list[int] = []
    ready_other: list[int] = []
    for n in compute:
        if pending[n] == 0:
            heapq.heappush(ready_ok if n in supported else ready_other, index[n])
    order = first
    while ready_ok or ready_other:
        queue = ready_ok if ready_ok else ready_other
        node = compute[heapq.heappop(queue)]
        order.append(node)
        for user in node.users:
            if user in pending:
                pending[user] -= 1
                if pending[user] == 0:
                    heapq.heappush(ready_ok if user in supported else ready_other, index[user])
    return order
