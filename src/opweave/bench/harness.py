"""`opweave bench`: every backend on every model, in worker processes, interleaved.

Per model: each backend's worker is prepared in turn (so compile times are not contended),
all are warmed up, then timed in rounds whose orders form a Williams square, one run of
each backend at a time (one call, or with `calls` N calls in a row, each after `pause_ms`
idle if set); then each reports its peak memory during one more call. Eager is always
measured: it is the reference for accuracy and the baseline of the ratios.
"""
from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Sequence

import numpy as np

from . import cpu, roofline
from .stats import (Summary, geometric_mean, median_interval, ratio_matrix, round_robin,
                    runs_within_budget)
from .modes import INFER, TRAIN
from .worker import CALLERS, BackendUnavailable, Worker, WorkerError, WorkerSpec

REFERENCE = "eager"
DEFAULT_BACKENDS = ("eager", "inductor", "inductor-freezing", "onnxruntime", "tvm", "openvino",
                    "opweave")
TRAIN_BACKENDS = ("eager", "inductor", "opweave")
TOLERANCE = {INFER: 1e-3, TRAIN: 1e-3}
# backends that compute in bf16 or int8 by the user's choice (`opweave bench --precision`)
PRECISION_BACKENDS = {
    "bf16": ("eager", "opweave", "opweave-bf16", "opweave-dynamo-bf16", "inductor-freezing",
             "inductor-bf16", "openvino", "openvino-bf16"),
    # bf16x3 keeps float32's accuracy, so it is held to float32's tolerance
    "bf16x3": ("eager", "opweave", "opweave-bf16x3", "opweave-bf16"),
    "int8": ("eager", "opweave", "opweave-int8", "opweave-dynamo-int8", "opweave-dynamic-int8",
             "onnxruntime", "onnxruntime-int8"),
}
# ... are held to their precision's tolerance instead: the relative L2 error of all outputs
# against eager's float32 ones (bf16 keeps 8 significant bits: 2^-9 = 0.2% per rounding;
# int8 activations 8 bits over each tensor's whole range)
LOW_PRECISION_REL_L2 = {"bf16": 2e-2, "int8": 1e-1}
OK, UNAVAILABLE, ERROR = "ok", "unavailable", "error"


@dataclass(frozen=True)
class BenchConfig:
    models: Sequence[str]
    backends: Sequence[str] = DEFAULT_BACKENDS
    mode: str = INFER
    batch: int = 1
    runs: int = 10
    warmup: int = 3
    # calls per run: 1, one call after the other backends ran, its threads idle (what a
    # model called now and then meets); N > 1, N calls in a row, the sample their mean
    # without the first, which pays for the pause (what a model called back to back meets)
    calls: int = 1
    # milliseconds the worker sleeps before each timed call: its threads and vCPUs idle
    # that long first, as a model served now and then meets (docs/runtime.md)
    pause_ms: float = 0.0
    # which thread of a worker calls the model: "main", the one that built and prepared
    # it, or "thread", one other thread for all its calls, as a server's handler thread
    caller: str = "main"
    threads: int = os.cpu_count() or 1
    small: bool = False
    setup_timeout_s: float = 1800.0
    seconds_per_backend: float = 60.0  # timing budget: slow backends get fewer runs (min 3)
    log_dir: str | None = None  # workers' stdout/stderr go to <log_dir>/<model>-<backend>.log

    def __post_init__(self):
        if self.calls < 1:
            raise ValueError(f"calls per run must be at least 1, got {self.calls}")
        if not (math.isfinite(self.pause_ms) and self.pause_ms >= 0):
            raise ValueError(f"the pause before each call must be a finite 0 ms or more, got "
                             f"{self.pause_ms}")
        if self.caller not in CALLERS:
            raise ValueError(f"the caller must be one of {', '.join(CALLERS)}, got "
                             f"{self.caller!r}")

    def log_path(self, model: str, backend: str | None) -> str | None:
        if self.log_dir is None:
            return None
        return os.path.join(self.log_dir, f"{model}-{backend or 'helper'}.log")

    def ordered_backends(self) -> list[str]:
        """Eager first (always measured), then the requested ones in order, once each."""
        return list(dict.fromkeys([REFERENCE, *self.backends]))


@dataclass
class BackendResult:
    backend: str
    status: str = OK
    reason: str = ""  # why it is unavailable or failed
    note: str = ""  # how it ran (e.g. an export formulation)
    setup_s: float | None = None
    samples: list[float] = field(default_factory=list)  # seconds per call, one per run
    rounds: list[int] = field(default_factory=list)  # the round each sample was timed in
    first_calls: list[float] = field(default_factory=list)  # with calls > 1: each run's first
    max_abs_diff: float | None = None
    rel_l2_diff: float | None = None  # ||outputs - eager's|| / ||eager's||, all outputs
    peak_rss: int | None = None
    torch_peak: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK and bool(self.samples)

    def accurate(self, tolerance: float) -> bool:
        """Checked against eager and within `tolerance` of it (absolute), or, for a
        backend that computes in bf16, within `LOW_PRECISION_REL_L2` (relative L2)."""
        low = low_precision(self.backend)
        if low:
            return self.rel_l2_diff is not None and self.rel_l2_diff <= LOW_PRECISION_REL_L2[low]
        return self.max_abs_diff is not None and self.max_abs_diff <= tolerance

    @property
    def summary(self) -> Summary | None:
        return Summary.of(self.samples) if self.samples else None

    def fail(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Paired:
    """`backend`'s time as a multiple of `other`'s in the rounds that timed both: the
    median of the per-round ratios, and the interval that holds the median of what such
    rounds give with probability `coverage` (`stats.median_interval`)."""

    backend: str
    other: str
    median: float
    low: float
    high: float
    coverage: float
    runs: int

    @property
    def verdict(self) -> str:
        """"faster" or "slower" where the whole interval says so, else "level"."""
        return "faster" if self.high < 1 else "slower" if self.low > 1 else "level"


@dataclass
class ModelResult:
    model: str
    notes: str = ""
    flops: float | None = None
    backends: dict[str, BackendResult] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        return {b: r.summary.median for b, r in self.backends.items() if r.ok}

    def ratios(self) -> dict[str, dict[str, float]]:
        return ratio_matrix(self.medians())

    def paired(self, backend: str, other: str) -> Paired | None:
        """`backend`'s time as a multiple of `other`'s, run by run: over the rounds that
        timed both (next to each other, so in the same phase of a shared machine's
        noise), the median ratio and its confidence interval; None with no such round."""
        a, b = self.backends.get(backend), self.backends.get(other)
        if a is None or b is None or not (a.ok and b.ok):
            return None
        theirs = dict(zip(b.rounds, b.samples))
        ratios = [mine / theirs[r] for r, mine in zip(a.rounds, a.samples) if r in theirs]
        if not ratios:
            return None
        return Paired(backend, other, *median_interval(ratios), len(ratios))

    def speedup_over_eager(self, backend: str) -> float | None:
        medians = self.medians()
        if backend in medians and REFERENCE in medians:
            return medians[REFERENCE] / medians[backend]
        return None


@dataclass
class BenchResult:
    config: BenchConfig
    machine: dict
    models: list[ModelResult]

    def against_peers(self) -> list[tuple[str, Paired]]:
        """(model, comparison) of each opweave backend with each model's fastest other
        backend (by median, among those that gave eager's results; eager counts), run by
        run: whether it is faster beyond the run's noise, as one median cannot say."""
        tolerance = TOLERANCE[self.config.mode]
        found = []
        for model in self.models:
            medians = model.medians()
            peers = {name: m for name, m in medians.items()
                     if not name.startswith("opweave") and model.backends[name].accurate(tolerance)}
            if not peers:
                continue
            peer = min(peers, key=peers.get)
            for name in medians:
                paired = model.paired(name, peer) if name.startswith("opweave") else None
                if paired is not None:
                    found.append((model.model, paired))
        return found

    def geomean_speedup(self, backend: str, over: str = REFERENCE) -> float | None:
        """Geometric mean of median(over) / median(backend) over the models where both ran
        and both gave eager's results (a fast wrong answer is no speed-up)."""
        tolerance = TOLERANCE[self.config.mode]
        ratios = [m.ratios()[backend][over] for m in self.models
                  if backend in m.medians() and over in m.medians()
                  and m.backends[backend].accurate(tolerance)
                  and m.backends[over].accurate(tolerance)]
        return geometric_mean(ratios) if ratios else None


class _NoProgress:
    def update(self, n=1):
        pass

    def set_description(self, text):
        pass


def low_precision(backend: str) -> str | None:
    """The lower precision a backend computes in ("bf16", "int8"), or None (float32)."""
    return next((p for p in LOW_PRECISION_REL_L2 if backend.endswith(f"-{p}")), None)


def rel_l2_diff(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> float:
    """||got - expected|| / ||expected|| over all outputs together (their finite entries;
    `max_abs_diff` has checked that the outputs correspond)."""
    num = den = 0.0
    for g, e in zip(got, expected):
        g64, e64 = g.astype(np.float64).ravel(), e.astype(np.float64).ravel()
        finite = np.isfinite(g64) & np.isfinite(e64)
        num += float(np.sum((g64[finite] - e64[finite]) ** 2))
        den += float(np.sum(e64[finite] ** 2))
    return (num / den) ** 0.5 if den else (0.0 if num == 0 else float("inf"))


def max_abs_diff(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> float:
    """Largest absolute difference over corresponding outputs (inf where one side is NaN
    or infinite and the other is not); ValueError when the outputs do not correspond."""
    if len(got) != len(expected):
        raise ValueError(f"{len(got)} outputs where eager has {len(expected)}")
    worst = 0.0
    for i, (g, e) in enumerate(zip(got, expected)):
        if g.shape != e.shape:
            raise ValueError(f"output {i} has shape {tuple(g.shape)}, eager {tuple(e.shape)}")
        if not g.size:
            continue
        g64, e64 = g.astype(np.float64), e.astype(np.float64)
        same_special = (np.isnan(g64) & np.isnan(e64)) | (np.isinf(e64) & (g64 == e64))
        if np.any(~np.isfinite(g64) & ~same_special) or np.any(~np.isfinite(e64) & ~same_special):
            return float("inf")
        finite = ~same_special
        if np.any(finite):
            worst = max(worst, float(np.max(np.abs(g64[finite] - e64[finite]))))
    return worst


def machine_description(config: BenchConfig) -> dict:
    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return dict(cpu=roofline.cpu_name(), cpus=os.cpu_count(), threads=config.threads,
                cpu_info=cpu.describe(config.threads),
                platform=platform.platform(), python=platform.python_version(),
                versions={p: version(p) for p in ("torch", "onnxruntime", "onnx", "apache-tvm",
                                                  "openvino", "opweave")},
                date=time.strftime("%Y-%m-%d %H:%M:%S %z"))


def run(config: BenchConfig, progress=None, worker_factory=Worker) -> BenchResult:
    """Measure every backend of `config` on every model; never raises for one backend."""
    progress = progress or _NoProgress()
    machine = machine_description(config)
    helper_spec = WorkerSpec(model=config.models[0] if config.models else "", mode=config.mode,
                             threads=config.threads, log_path=config.log_path("gemm", None))
    try:
        with worker_factory(helper_spec) as helper:
            peak, cached = roofline.gemm_peak(config.threads, lambda: helper.call("gemm_peak"))
    except (WorkerError, ValueError) as error:  # no roofline column; the timings still run
        peak, cached = None, False
        machine["gemm_peak_error"] = _last_line(str(error))
    machine.update(gemm_peak_flops=peak, gemm_peak_cached=cached)
    results = [run_model(config, name, progress, worker_factory) for name in config.models]
    return BenchResult(config, machine, results)


def run_model(config: BenchConfig, name: str, progress=None,
              worker_factory=Worker) -> ModelResult:
    progress = progress or _NoProgress()
    result = ModelResult(name)
    spec = dict(model=name, mode=config.mode, threads=config.threads, batch=config.batch,
                small=config.small, caller=config.caller)
    progress.set_description(f"{name}: FLOPs")
    with worker_factory(WorkerSpec(log_path=config.log_path(name, None), **spec)) as helper:
        try:
            result.notes = helper.call("notes", timeout=config.setup_timeout_s)
            result.flops = helper.call("flops", timeout=config.setup_timeout_s)
        except (WorkerError, BackendUnavailable) as error:
            result.notes = "; ".join(filter(None, [result.notes, "FLOPs unavailable: "
                                                   + _last_line(str(error))]))
    progress.update(1)

    workers: dict[str, Worker] = {}
    reference_outputs = None
    try:
        for backend in config.ordered_backends():
            entry = result.backends[backend] = BackendResult(backend)
            progress.set_description(f"{name}: preparing {backend}")
            log_path = config.log_path(name, backend)
            worker = worker_factory(WorkerSpec(backend=backend, log_path=log_path, **spec))
            try:
                prepared = worker.call("prepare", timeout=config.setup_timeout_s)
            except BackendUnavailable as reason:
                entry.fail(UNAVAILABLE, str(reason))
                worker.close()
            except WorkerError as error:
                entry.fail(ERROR, _last_line(str(error)))
                worker.close()
            else:
                workers[backend] = worker
                entry.setup_s, entry.note = prepared["setup_s"], prepared["note"]
                if backend == REFERENCE:
                    reference_outputs = prepared["outputs"]
                elif reference_outputs is not None:
                    try:
                        entry.max_abs_diff = max_abs_diff(prepared["outputs"], reference_outputs)
                        entry.rel_l2_diff = rel_l2_diff(prepared["outputs"], reference_outputs)
                    except ValueError as mismatch:
                        entry.fail(ERROR, f"outputs do not match eager's: {mismatch}")
            progress.update(1)
        if REFERENCE in workers:
            result.backends[REFERENCE].max_abs_diff = result.backends[REFERENCE].rel_l2_diff = 0.0
        _measure(config, name, result, workers, progress)
    finally:
        for worker in workers.values():
            worker.close()
    return result


def _measure(config, name, result, workers, progress) -> None:
    def call(backend, command, *args):
        try:
            return workers[backend].call(command, *args, timeout=config.setup_timeout_s)
        except (WorkerError, BackendUnavailable) as error:
            result.backends[backend].fail(ERROR, f"{command}: {_last_line(str(error))}")
            result.backends[backend].samples.clear()
            result.backends[backend].rounds.clear()
            result.backends[backend].first_calls.clear()
            workers.pop(backend).close()
            return None

    def ready():
        return [b for b in workers if result.backends[b].status == OK]

    progress.set_description(f"{name}: warm-up")
    per_call = {}
    for backend in ready():
        spent, calls = 0.0, []
        while len(calls) < max(config.warmup, 1) and spent < config.seconds_per_backend / 4:
            samples = call(backend, "run", 1)
            if not samples:
                break
            calls += samples
            spent += samples[0]
        if calls:
            per_call[backend] = min(calls)
    plan = {b: runs_within_budget((per_call[b] + config.pause_ms / 1e3) * config.calls,
                                  config.runs, config.seconds_per_backend)
            for b in ready() if b in per_call}
    for backend, count in plan.items():
        if count < config.runs:
            entry = result.backends[backend]
            runs = "1 run" if count == 1 else f"{count} runs"
            entry.note = "; ".join(filter(None, [entry.note, f"{runs} (slow)"]))
    progress.set_description(f"{name}: timing")
    for index, order in enumerate(round_robin(plan)):
        for backend in order:
            if backend in workers:
                samples = call(backend, "run", config.calls, config.pause_ms / 1e3)
                if samples:
                    entry = result.backends[backend]
                    entry.samples.append(sample_of(samples))
                    entry.rounds.append(index)
                    if len(samples) > 1:
                        entry.first_calls.append(samples[0])
        progress.update(1)
    progress.update(config.runs - len(round_robin(plan)))
    progress.set_description(f"{name}: memory")
    for backend in ready():
        entry = result.backends[backend]
        try:  # a failed memory probe costs the memory figures, not the timings
            memory = workers[backend].call("memory", timeout=config.setup_timeout_s)
        except (WorkerError, BackendUnavailable) as error:
            entry.note = "; ".join(filter(None, [entry.note, "memory not measured: "
                                                 + _last_line(str(error))]))
            continue
        entry.peak_rss, entry.torch_peak = memory.get("peak_rss"), memory.get("torch_peak")


def sample_of(calls: list[float]) -> float:
    """A run's sample from the seconds of its calls (`BenchConfig.calls`)."""
    return calls[0] if len(calls) == 1 else sum(calls[1:]) / (len(calls) - 1)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def steps_per_model(config: BenchConfig) -> int:
    """Progress-bar steps per model: FLOPs, one per backend prepared, one per round."""
    return 1 + len(config.ordered_backends()) + config.runs
