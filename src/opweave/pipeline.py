"""The compiler's pipeline, in one place. Every frontend (torch.export, Dynamo, training,
ONNX) only captures its model and lowers it to IR graphs; each graph then goes through
`compile_graph`:

    verify -> rewrite -> gemm-layout -> lower (fusion partition + kernels)
           -> remat (only with a memory budget) -> Executor

A graph pass is a `Pass`: a name and `run(graph, options) -> (graph, detail)`, where
`detail` is the pass's own report. `PassRun` applies them with its instruments: it times
each pass, verifies the IR after it (`Options.verify`), and with `Options.debug_dir`
(`OPWEAVE_DEBUG=1`) writes the IR after every pass, the pass timings, the partition and
the generated C++. An optional pass that fails warns once and leaves the graph as it was:
a compiler bug must not cost the user their model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from . import cost, tune
from .tune import configs, roofline
from .files import atomic_write
from .ir import Graph, verify
from .ir.outline import OutlineNode, outline
from .ir.text import parse_graph, print_graph
from .notices import OpweaveFallbackWarning, warn_once
from .options import Options, RewriteOptions
from .codegen import int8
from .codegen import precision as prec
from .runtime import Executor, allocator
from .runtime.executor import copied_from
from .runtime.cuda_graphs import CudaGraphed


class PassWarning(OpweaveFallbackWarning):
    """An optional pass failed on a graph and was skipped; the graph runs without it."""


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Graph, Options], tuple[Graph, object]]
    optional: bool = False  # on failure: warn once, keep the input graph


@dataclass
class PassReport:
    name: str
    seconds: float
    nodes_before: int
    nodes_after: int
    detail: object = None   # the pass's own report (RewriteReport, Lowered, text)
    failed: str = ""        # why an optional pass was skipped

    def __str__(self) -> str:
        what = f"skipped: {self.failed}" if self.failed else _summary(self.detail)
        return (f"{self.name:<12} {self.seconds * 1e3:9.1f} ms  {self.nodes_before:>5} -> "
                f"{self.nodes_after:<5} nodes  {what}").rstrip()


def _summary(detail) -> str:
    if detail is None:
        return ""
    text = str(detail).splitlines()
    return text[0] if text else ""


def _full(report: PassReport) -> str:
    """The report's line, then the rest of its detail indented (for the debug dump)."""
    rest = str(report.detail).splitlines()[1:] if report.detail is not None else []
    return "".join([f"{report}\n"] + [f"    {line}\n" for line in rest])


# -- the graph passes ---------------------------------------------------------------------

def _verify(graph: Graph, options: Options):
    verify(graph)
    return graph, None


def _rewrite(graph: Graph, options: Options):
    from .passes.rewrite.pipeline import rewrite

    return rewrite(graph, options.rewrite)


def _on_a_copy(edit, graph: Graph) -> tuple[Graph, int]:
    """`edit` (a pass that edits in place and counts its changes) run on a copy, so that a
    failure leaves its input whole; the copy where it changed anything."""
    copy = parse_graph(print_graph(graph), dict(graph.constants))
    changed = edit(copy)
    return (copy if changed else graph), changed


def _gemm_layout(graph: Graph, options: Options):
    from .passes.gemm_layout import transpose_gemm_weights

    graph, changed = _on_a_copy(transpose_gemm_weights, graph)
    return graph, f"{changed} GEMM weight(s) stored transposed"


def _batchnorm_affine(graph: Graph, options: Options):
    from .passes.batchnorm_affine import batch_norm_as_affine

    graph, changed = _on_a_copy(batch_norm_as_affine, graph)
    return graph, f"{changed} batch norm(s) as scale and shift"


def _view_chains(graph: Graph, options: Options):
    from .passes.view_chains import merge_view_chains, mergeable_chains

    if not mergeable_chains(graph):  # (most graphs: no copy made)
        return graph, "0 chain(s) of reshapes and permutes as one permute"
    graph, changed = _on_a_copy(merge_view_chains, graph)
    return graph, f"{changed} chain(s) of reshapes and permutes as one permute"


GRAPH_PASSES: tuple[Pass, ...] = (
    Pass("verify", _verify),
    Pass("rewrite", _rewrite, optional=True),
    Pass("view-chains", _view_chains, optional=True),
    Pass("gemm-layout", _gemm_layout, optional=True),
    Pass("batchnorm-affine", _batchnorm_affine, optional=True),
)


# -- running them ---------------------------------------------------------------------------

class PassRun:
    """Applies passes to one graph with the instruments `options` asks for."""

    def __init__(self, options: Options, name: str, strict: bool = False):
        self.options = options
        self.name = name
        self.strict = strict  # optional passes raise too
        self.reports: list[PassReport] = []
        self.dump_dir = Path(options.debug_dir) / name if options.debug_dir else None

    def apply(self, p: Pass, graph: Graph) -> Graph:
        start, before = time.perf_counter(), len(graph.nodes)
        try:
            new, detail = p.run(graph, self.options)
            if self.options.verify:
                verify(new)
        except Exception as err:  # noqa: BLE001  (optional passes fail soft, loudly)
            if not p.optional or self.strict:
                raise
            reason = f"{type(err).__name__}: {err}"
            warn_once(f"opweave's {p.name} pass failed on {graph.name} and was skipped: {reason}",
                      PassWarning)
            self._record(PassReport(p.name, time.perf_counter() - start, before, before,
                                    failed=reason), graph)
            return graph
        self._record(PassReport(p.name, time.perf_counter() - start, before, len(new.nodes),
                                detail), new)
        return new

    def lower(self, graph: Graph) -> Executor:
        """The last stage: the graph as an executable plan of fused steps."""
        from .codegen import FusionWarning, lower
        from .codegen.report import partition_report

        masks = self._hoist_masks(graph) if self.options.memory_budget is not None else ()
        start, size = time.perf_counter(), len(graph.nodes)
        precision = self.options.precision
        device = self.options.device or "cpu"
        on_gpu = device.startswith("cuda")
        if on_gpu and not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} was asked for {graph.name}, but torch "
                               f"{torch.__version__} sees no CUDA GPU; use device='cpu' or "
                               "'auto'")
        # before anything is measured, so measurements see memory as the calls will
        kept = "; freed memory kept for the next call" \
            if not on_gpu and allocator.apply(self.options.allocator) else ""
        quantized = precision.startswith("int8")
        if quantized and on_gpu:
            raise ValueError(f"precision={precision!r} runs on the CPU (oneDNN's int8 "
                             f"primitives); int8 on {device} is not built: use device='cpu' or "
                             "another precision")
        if device == "auto":
            if torch.cuda.is_available() and self.options.memory_budget is None \
                    and not quantized:
                return self._placed(graph)
            device = "cpu"
            why = ("no CUDA GPU" if not torch.cuda.is_available() else "a memory budget"
                   if self.options.memory_budget is not None else "int8 runs on the CPU")
            self._record(PassReport("placement", 0.0, size, size,
                                    f"placement: all on the cpu ({why})"), None)
        if precision == "bf16" and not on_gpu and not prec.bf16_supported():
            warn_once("opweave: precision 'bf16' computes in float32 here: torch's oneDNN has "
                      "no bf16 on this CPU (it needs AVX-512 BW, AVX-NE-CONVERT or AMX)",
                      OpweaveFallbackWarning)
            precision = "fp32"
        if self.options.fusion == "off":
            if quantized:
                warn_once(f"opweave: {graph.name} computes in float32: int8 runs on fused "
                          "library groups, and fusion is off", FusionWarning)
            steps = None  # the executor's own step per op
            if self.options.memory_budget is not None or precision != "fp32":
                steps = lower(graph, "off", precision=precision).steps
            if self.options.memory_budget is not None:
                steps = self._rematerialized(graph, steps)
            executor = self._executor(graph, steps, device)
            self._record(PassReport("lower", time.perf_counter() - start, size, size,
                                    "fusion off: one step per op" + kept), None)
            return executor
        try:
            with tune.using(tune.open_db(self.options.tuning_db)):
                lowered = lower(graph, self.options.fusion, measure=self.options.measure,
                                ilp_seconds=self.options.partition_seconds,
                                precision=precision, apart=frozenset(masks),
                                target="triton" if on_gpu else "cpp",
                                kernels=self.options.kernels, recheck=self.options.recheck)
        except Exception as err:  # noqa: BLE001  (a fusion bug must not cost the model)
            reason = f"{type(err).__name__}: {err}"
            warn_once(f"opweave: fusion failed on {graph.name} and was skipped: {reason}",
                      FusionWarning)
            self._record(PassReport("lower", time.perf_counter() - start, size, size,
                                    failed=reason), None)
            return self._executor(graph, None, device)
        steps = lowered.steps
        if self.options.memory_budget is not None:
            steps = self._rematerialized(graph, steps)
        executor = self._executor(graph, steps, device)
        executor.lowered = lowered
        if on_gpu:
            executor = CudaGraphed(executor)
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(lowered.kernel_counts().items()))
        if lowered.rescheduled:
            counts += f" ({lowered.rescheduled} on tuned schedules)"
        counts += kept
        self._record(PassReport("lower", time.perf_counter() - start, size, len(lowered.steps),
                                f"{lowered.partition.method} partition: {counts}"), None)
        if self.dump_dir is not None:
            self._write("partition.txt", partition_report(lowered))
            name = "kernels.py" if on_gpu else "kernels.cpp"
            self._write(name, "\n".join(s.body for s in lowered.sources))
        return executor

    def _executor(self, graph: Graph, steps, device: str) -> Executor:
        """The graph's executor; with schedule="ios" or "critical-path", carrying the
        Staging that runs its steps in concurrent stages (schedule/concurrent.py)."""
        executor = Executor(graph, steps=steps, native=self.options.native, device=device,
                            workers=self.options.workers)
        quantized = [s.fn for s in steps or () if isinstance(s.fn, int8.Int8Group)]
        if quantized:
            gathers = [s.fn for s in steps if isinstance(s.fn, int8.CodeGather)]
            executor.calibration = int8.Calibration(quantized, gathers)
        if self.options.schedule != "sequential" and executor.native.mode != "off":
            from .schedule.concurrent import Staging

            executor.staging = Staging(self.options.schedule,
                                       tune.open_db(self.options.tuning_db))
            if self.dump_dir is not None:
                executor.staging.dump_to = self.dump_dir / "stages.txt"  # once decided
        return executor

    def _placed(self, graph: Graph):
        """device="auto": the graph's groups placed on the CPU and the GPU by their measured
        times (schedule/placement.py); one device's whole-graph plan when that is faster."""
        from .schedule.placed import OnDevice, PlacedExecutor, measure_costs
        from .schedule.placement import group, place

        start = time.perf_counter()
        compiled: dict[tuple[str, str], Callable] = {}

        def compile_group(g: Graph, device: str):
            key = (g.name, device)
            if key not in compiled:
                compiled[key] = PassRun(replace(self.options, device=device), g.name).lower(g)
            return compiled[key]

        groups = group(graph)
        placement = place(groups, measure_costs(graph, groups, compile_group))
        self._record(PassReport("placement", time.perf_counter() - start, len(graph.nodes),
                                len(groups), placement.explain(groups)), None)
        if placement.mixed:
            return PlacedExecutor(graph, groups, placement, compile_group)
        device = placement.devices[0] if placement.devices else "cpu"
        whole = PassRun(replace(self.options, device=device), graph.name)
        executor = whole.lower(graph)
        self.reports.extend(whole.reports)
        return OnDevice(executor, device)

    def _hoist_masks(self, graph: Graph) -> list:
        """Under a memory budget, activations the backward only compares with a constant
        are kept as masks (schedule/remat/masks.py), each computed on its own so that no
        fused kernel takes it back to the backward; the planner weighs them like any
        value. Returns the comparisons moved."""
        from .schedule.remat.masks import hoist_masks

        start = time.perf_counter()
        moved = hoist_masks(graph)
        self._record(PassReport("masks", time.perf_counter() - start, len(graph.nodes),
                                len(graph.nodes), f"{len(moved)} comparison(s) moved up to "
                                "keep masks instead of the values they compare"), graph)
        return moved

    def _rematerialized(self, graph: Graph, steps: list) -> list:
        """The steps in the order the memory budget asks for, recomputations included
        (schedule/remat/). A budget no schedule meets raises MemoryBudgetError: it is
        the caller's choice, not a compiler failure to fall back from."""
        from .schedule import remat

        start = time.perf_counter()
        problem = remat.analyse(steps, graph)
        unconstrained = remat.simulate_peak(problem, range(problem.n))
        budget = remat.resolve_budget(self.options.memory_budget, unconstrained)
        plan = remat.plan(problem, budget, deterministic=self.options.deterministic)
        self._record(PassReport("remat", time.perf_counter() - start, len(steps),
                                len(plan.order), plan), None)
        return [steps[i] for i in plan.order]

    def _record(self, report: PassReport, graph: Graph | None) -> None:
        self.reports.append(report)
        if self.dump_dir is None:
            return
        if graph is not None:
            self._write(f"{len(self.reports):02d}-{report.name}.ir", print_graph(graph))
        self._write("passes.txt", "".join(_full(r) for r in self.reports))

    def _write(self, filename: str, text: str) -> None:
        atomic_write(self.dump_dir / filename, lambda tmp: tmp.write_text(text))


@dataclass
class CompiledGraph:
    """One IR graph compiled: the graph after the passes, its executor and the reports."""

    graph: Graph
    executor: Executor
    reports: list[PassReport] = field(default_factory=list)
    key: tuple[str, str] | None = None  # the input graph's tune.configs.graph_key
    options: Options | None = None      # what it was compiled with (tuned or not)
    input_outline: list[OutlineNode] = field(default_factory=list)  # before the passes

    def __call__(self, *tensors):
        return self.executor(*tensors)

    def report(self, name: str):
        """The detail of pass `name` (e.g. the RewriteReport of "rewrite"), or None."""
        return next((r.detail for r in self.reports if r.name == name), None)


class TuningWarning(OpweaveFallbackWarning):
    """The tuning database could not be read for a compile; it compiled untuned."""


def _tuned_options(graph: Graph, key: str, options: Options) -> tuple[Options, PassReport | None]:
    """`options` with the configuration `opweave tune` recorded for this graph on this
    machine (tune/configs.py), and a report line saying so; unchanged without one, or
    when the database cannot be read (a cache never stops a compile)."""
    if not options.tuned or options.tuning_db is None:
        return options, None
    start = time.perf_counter()
    try:
        record = configs.recall(key, tune.open_db(options.tuning_db))
    except Exception as err:  # noqa: BLE001  (an unreadable database: compile untuned)
        warn_once(f"opweave: the tuning database {options.tuning_db} could not be read, so "
                  f"graphs compile untuned: {type(err).__name__}: {err}", TuningWarning)
        return options, None
    if record is None:
        return options, None
    detail = (f"{configs.describe_config(record.config)} from the tuning database "
              f"(model measured at {record.seconds * 1e3:.3f} ms)")
    size = len(graph.nodes)
    mode = RewriteOptions.resolve(record.config["rewrite"])  # the caller's other settings stay
    rewrite = replace(options.rewrite, engine=mode.engine, extractor=mode.extractor)
    tuned = replace(options, rewrite=rewrite, fusion=record.config["fusion"])
    return tuned, PassReport("tuned", time.perf_counter() - start, size, size, detail)


def _measured_machine(graph: Graph, options: Options) -> tuple[cost.Machine, PassReport | None]:
    """The roofline parameters `opweave tune machine` stored for this machine, and a
    report line saying so; the current ones (the defaults) without a record."""
    if options.tuning_db is None:
        return cost.active(), None
    start = time.perf_counter()
    try:
        machine = roofline.load(tune.open_db(options.tuning_db))
    except Exception as err:  # noqa: BLE001  (an unreadable database: the defaults)
        warn_once(f"opweave: the tuning database {options.tuning_db} could not be read, so "
                  f"graphs are costed with the default machine: {type(err).__name__}: {err}",
                  TuningWarning)
        return cost.active(), None
    if machine is None:
        return cost.active(), None
    detail = (f"measured roofline: {machine.flops / 1e9:.0f} GFLOP/s, "
              f"{machine.bandwidth / 1e9:.1f} GB/s from DRAM, {machine.cache_bandwidth / 1e9:.0f} "
              f"GB/s within {machine.cache_bytes / 2 ** 20:.2f} MiB, "
              f"{machine.launch * 1e6:.1f} us per op")
    size = len(graph.nodes)
    return machine, PassReport("machine", time.perf_counter() - start, size, size, detail)


@dataclass
class PreparedGraph:
    """A graph after the graph passes, not yet lowered: what compiling does once for a
    graph of symbolic sizes, before lowering it per binding (specializing.py)."""

    graph: Graph
    options: Options
    machine: cost.Machine
    reports: list[PassReport]
    key: tuple[str, str]
    input_outline: list[OutlineNode]


def prepare_graph(graph: Graph, options: Options, *, strict: bool = False) -> PreparedGraph:
    """Run the graph passes over `graph`, with its tuned configuration and this machine's
    measured roofline when the database has them. `strict`: an optional pass that fails
    raises instead of being skipped (the caller has another way to compile)."""
    _constants_on_cpu(graph)
    key = configs.graph_key(graph)
    before = outline(graph)
    options, tuned = _tuned_options(graph, key[0], options)
    machine, measured = _measured_machine(graph, options)
    run = PassRun(options, graph.name, strict=strict)
    run.reports.extend(r for r in (tuned, measured) if r is not None)
    with cost.using(machine):
        for p in GRAPH_PASSES:
            graph = run.apply(p, graph)
    return PreparedGraph(graph, options, machine, run.reports, key, before)


def _constants_on_cpu(graph: Graph) -> None:
    """The passes fold and transform weights on the CPU, whatever device they came from;
    the executor puts them on the device the graph runs on (a weight no pass changed is
    the model's own tensor there: no second copy)."""
    for name, value in graph.constants.items():
        if value.device.type != "cpu":
            host = value.cpu()
            copied_from(host, value)  # an unchanged weight runs from where it was
            graph.constants[name] = host


def lower_prepared(prepared: PreparedGraph, graph: Graph | None = None) -> CompiledGraph:
    """Lower a prepared graph, or `graph` in its place (the prepared graph specialized to
    concrete sizes), to an executor; the plan's reports are the passes' and its own."""
    graph = prepared.graph if graph is None else graph
    run = PassRun(prepared.options, graph.name)
    run.reports.extend(prepared.reports)
    with cost.using(prepared.machine):
        executor = run.lower(graph)
    return CompiledGraph(graph, executor, run.reports, prepared.key, prepared.options,
                         prepared.input_outline)


def compile_graph(graph: Graph, options: Options) -> CompiledGraph:
    """Run every pass over `graph` and lower it to an executor."""
    return lower_prepared(prepare_graph(graph, options))


__all__ = ["Pass", "PassReport", "PassRun", "PassWarning", "TuningWarning", "CompiledGraph",
           "PreparedGraph", "compile_graph", "prepare_graph", "lower_prepared", "GRAPH_PASSES"]
