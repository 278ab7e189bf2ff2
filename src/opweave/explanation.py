"""`opweave.explain`: what opweave makes of a model, before you rely on it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .frontends.program import Coverage


@dataclass
class Explanation:
    name: str
    capture: str                      # how the graph was captured: export, make_fx or eager
    coverage: Coverage
    ir_ops: dict[str, int]            # IR op -> count, over all opweave segments
    graph_breaks: int | None          # Dynamo graph breaks under torch.compile (None: not measured)
    break_reasons: list[str] = field(default_factory=list)
    flops: int = 0
    bytes_moved: int = 0
    capture_error: str = ""
    rewrites: list = field(default_factory=list)  # RewriteReport per segment
    runtime: list[str] = field(default_factory=list)  # how each segment's calls run
    memory: list[str] = field(default_factory=list)  # training: each segment's peak and plan
    precision: str = ""  # with a lower precision: which steps run in it, on which units
    dynamic: list[str] = field(default_factory=list)  # each symbolic segment: plans, peak

    @property
    def captured(self) -> bool:
        """Whether opweave captured a graph at all (else the whole model runs in eager)."""
        return self.capture != "eager"

    @property
    def share(self) -> float | None:
        """The share of ATen ops opweave runs; None when it captured no graph."""
        return self.coverage.share if self.captured else None

    def __str__(self) -> str:
        cov = self.coverage
        if not self.captured:  # no graph: a coverage figure would describe nothing
            lines = [f"model {self.name}: captured with eager: nothing runs in opweave"
                     + (f" ({self.capture_error})" if self.capture_error else ""),
                     "  coverage: n/a (no graph was captured)"]
        else:
            lines = [
                f"model {self.name}: captured with {self.capture}"
                + (f" ({self.capture_error})" if self.capture_error else ""),
                f"  ATen ops: {cov.total}, run by opweave: {sum(cov.supported.values())} "
                f"({cov.share:.1%}), in eager: {sum(cov.fallback.values())}",
                f"  IR: {sum(self.ir_ops.values())} nodes in {cov.segments} segment(s); "
                f"{self.flops / 1e9:.3f} GFLOP, {self.bytes_moved / 2**20:.1f} MiB moved unfused",
                "  IR ops: " + ", ".join(f"{op} {n}" for op, n in self.ir_ops.items()),
            ]
            if cov.fallback:
                lines.append("  fallbacks: " + ", ".join(
                    f"{op} x{n} ({cov.reasons.get(op, '')})"
                    for op, n in cov.fallback.most_common()))
            else:
                lines.append("  fallbacks: none")
            for i, how in enumerate(self.runtime):
                lines.append(f"  segment {i} runs as: {how}")
            for i, plan in enumerate(self.memory):
                lines.append(f"  segment {i} memory: {plan}")
            for line in self.dynamic:
                lines.append(f"  {line}")
            if self.precision:
                lines.append(f"  precision: {self.precision}")
            if cov.fallback:
                lines.append("  eager ops between segments run from Python, one call each")
        lines.extend(str(r) for r in self.rewrites)
        if self.graph_breaks is None:
            lines.append("  graph breaks under torch.compile: not measured")
        else:
            lines.append(f"  graph breaks under torch.compile: {self.graph_breaks}")
            lines.extend(f"    - {r}" for r in self.break_reasons[:10])
        return "\n".join(lines)


def _dynamo_breaks(model, example_inputs) -> tuple[int | None, list[str]]:
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            report = torch._dynamo.explain(model)(*example_inputs)
        return report.graph_break_count, [str(b.reason).splitlines()[0] for b in report.break_reasons]
    except Exception as err:  # explain must not fail because Dynamo does
        return None, [f"Dynamo failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"]
    finally:
        torch._dynamo.reset()


def explain(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
            name: str | None = None, graph_breaks: bool = True, rewrite=None,
            train: bool = False, memory_budget=None, precision=None,
            dynamic_shapes=None, device=None, schedule=None) -> Explanation:
    """Compile `model` as `opweave.compile` does and report coverage, the IR (after the
    rewrite pass) and what the rewrite pass did: rules fired where, cost before and after.
    With `train=True` (and optionally `memory_budget`), the training step: each joint
    graph's peak memory, and what rematerialization recomputed to meet the budget. With
    `precision="bf16"`, how many steps compute in bf16 and on which of the CPU's units.
    With `dynamic_shapes` (as `opweave.compile`'s), each symbolic segment's symbols, the
    sizes compiled so far and its peak memory as a formula over the symbols. With
    `device="auto"`, where each group of operators runs (CPU or GPU) and why. With
    `schedule="ios"` or "critical-path", the stages each graph runs in."""
    import warnings

    from .frontends.torch_export import compile as compile_model
    from .frontends.program import OpweaveFallbackWarning

    name = name or type(model).__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpweaveFallbackWarning)  # the report says it all
        compiled = compile_model(model, example_inputs, name=name, rewrite=rewrite,
                                 train=train, memory_budget=memory_budget, precision=precision,
                                 dynamic_shapes=dynamic_shapes, device=device,
                                 schedule=schedule)
    program = _program(compiled)
    runtime = _runtime(compiled, program, example_inputs)
    ir_ops: dict[str, int] = {}
    flops = moved = 0
    for graph in _costed_graphs(compiled, program):
        for op, n in graph.op_counts().items():
            ir_ops[op] = ir_ops.get(op, 0) + n
        cost = graph.cost()
        flops, moved = flops + cost.flops, moved + cost.bytes
    ir_ops = dict(sorted(ir_ops.items(), key=lambda kv: (-kv[1], kv[0])))
    breaks, reasons = _dynamo_breaks(model, example_inputs) if graph_breaks else (None, [])
    if train:
        capture, coverage, error = ("aot-joint", program.coverage, "") if program else \
            ("eager", Coverage(), "the training step could not be captured")
    else:
        capture, coverage, error = compiled.capture, compiled.coverage, compiled.capture_error
    return Explanation(name, capture, coverage, ir_ops, breaks, reasons, flops, moved, error,
                       program.rewrites if program else [], runtime,
                       [_memory(g) for g in program.compiled_graphs] if train and program else [],
                       _precision(program, precision) if program else "",
                       _dynamic(program) if program else [])


def _dynamic(program) -> list[str]:
    """Where each size symbol comes from, and each symbolic segment's plans and peak."""
    if not program.symbolic_graphs:
        return []
    sources = ", ".join(f"{name} = " + (f"size argument {i}" if axis is None else
                                        f"axis {axis} of argument {i}")
                        for name, i, axis in program.symbol_sources)
    return [f"symbols: {sources}"] + [f"symbolic segment {i}: {g.describe()}"
                                      for i, g in enumerate(program.symbolic_graphs)]


def _costed_graphs(compiled, program) -> list:
    """The graphs whose ops and cost explain reports: a symbolic segment's by the plan of
    the example's sizes (its cost is a number only for concrete sizes)."""
    if program is None or not program.symbolic_graphs:
        return compiled.graphs
    return [g.graph for g in program.compiled_graphs]


def _precision(program, precision) -> str:
    """How many steps compute in the lower precision (a group whose float32 form measured
    faster keeps it), and the CPU's units for it."""
    from .codegen import int8
    from .codegen.precision import tally, units

    if precision in (None, "fp32"):
        return ""
    steps = [s for g in program.compiled_graphs for s in g.executor.lowered_steps or []]
    low, eligible = tally(steps, precision)
    if precision == "int8":
        requantizing = sum(getattr(s.fn, "requantize", None) is not None for s in steps)
        return (f"int8: {low} of {eligible} linear/convolution steps in int8, {requantizing} "
                f"of them writing uint8 for the next (the rest measured faster in float32, "
                f"or end in an activation oneDNN does not fuse in int8); this CPU: "
                f"{int8.units()}")
    if precision == "int8-dynamic":
        return (f"int8-dynamic: {low} of {eligible} linear steps in int8, each activation "
                f"quantized at its own call's range (the rest measured faster in float32); "
                f"this CPU: {int8.units()}")
    if precision == "bf16x3":
        return (f"bf16x3: {low} of {eligible} linear/convolution steps from three bf16 parts "
                f"(float32's accuracy; the rest measured faster in float32, or this CPU has "
                f"no bf16 products); this CPU: {units()}")
    return (f"{precision}: {low} of {eligible} product/convolution/attention steps in bf16 "
            f"(the rest measured faster in float32); this CPU: {units()}")


def _program(compiled):
    """The CompiledProgram behind what opweave.compile returned (None: all in eager)."""
    programs = getattr(compiled, "programs", None)  # a TrainingModel
    if programs is not None:
        return programs.get(True) or programs.get(False)
    return compiled.program


def _memory(graph) -> str:
    """A compiled graph's peak memory: the remat plan's report, or the plain peak."""
    from .schedule import remat

    plan = graph.report("remat")
    if plan is not None:
        return str(plan)
    peak = remat.planned_peak(graph)
    if peak is None:
        return "peak not planned (the graph runs op by op)"
    return f"peak {peak / 2 ** 20:.1f} MiB (no memory budget)"


def _runtime(compiled, program, example_inputs) -> list[str]:
    """How each segment's calls run (native plan or Python steps, and why), after the
    calls it takes to record and check the native plan."""
    from .runtime import native

    if program is None:
        return []
    graphs = program.compiled_graphs
    if any(g.executor.native.mode != "off" for g in graphs):
        native.module(wait=True)
    stagings = [getattr(g.executor, "staging", None) for g in graphs]
    # the native plan is active after RECORD_AT_CALL + 1 calls; stages are decided at the next
    calls = native.RECORD_AT_CALL + 1 + any(s is not None for s in stagings)
    try:
        with torch.no_grad():
            for _ in range(calls):
                compiled(*example_inputs)
    except Exception as err:  # noqa: BLE001  (explain reports; it does not fail)
        return [f"not run ({type(err).__name__}: {err})" for _ in graphs]
    return [g.executor.native.describe() + (f"; {g.report('tuned')}" if g.report("tuned") else "")
            + (f"\n{g.report('placement')}" if g.report("placement") else "")
            + ("\n" + "\n".join(staging.describe()) if staging is not None else "")
            for g, staging in zip(graphs, stagings)]
