"""Every compiler option in one frozen value, and the one place the environment is read.

`Options.resolve(...)` is how each entry point (opweave.compile, the Dynamo backend,
from_onnx, training) turns what a user passed into options: explicit arguments first,
then the environment (`OPWEAVE_*`, read here and nowhere else), then the defaults.
Every value is validated with an error that names the option and what it accepts.

Environment variables:
  OPWEAVE_REWRITE        eqsat | greedy (eqsat with greedy extraction) | backtrack | off
  OPWEAVE_FUSION         ilp | greedy | off
  OPWEAVE_MEASURE        1 (default) | 0: choose library forms by the cost model, not by timing
  OPWEAVE_DETERMINISTIC  0 (default) | 1: no wall-clock deadlines in the solvers
  OPWEAVE_VERIFY         1 (default) | 0: skip verifying the IR after each pass
  OPWEAVE_TUNED          1 (default) | 0: ignore the whole-graph configurations `opweave tune`
                         recorded (setting OPWEAVE_REWRITE or OPWEAVE_FUSION ignores them too)
  OPWEAVE_TUNING_DB      a path (default: tuning.sqlite under opweave's cache directory) |
                         off: no database, choices measured and kept for the process only
  OPWEAVE_NATIVE         background (default) | wait | off: the native execution plan
                         (runtime/native.py): built in a thread at the first compile, built
                         before the first call that needs it, or never used
  OPWEAVE_SCHEDULE       sequential (default) | ios | critical-path: run independent
                         steps in concurrent stages on shares of the cores, kept only when
                         measured faster (schedule/concurrent.py)
  OPWEAVE_KERNELS        recorded (default) | default | tune: the generated kernels'
                         schedules: as the tuning database records them for this machine,
                         always the default ones, or measured where none is recorded
                         (codegen/kernel_schedule.py; `opweave tune MODEL` does this)
  OPWEAVE_RECHECK        0 (default) | 1: measure the recorded library forms again and
                         decide on all their samples (`opweave tune MODEL` does)
  OPWEAVE_ALLOCATOR      keep (default) | system: keep memory freed between calls mapped
                         (glibc's malloc thresholds, runtime/allocator.py), or leave the C
                         library's policy alone
  OPWEAVE_WORKERS        apart (default) | system: from a native plan's call on, the calling
                         thread's OpenMP workers run on every allowed CPU but the caller's
                         (a call after an idle gap no longer waits out a scheduler tick), or
                         are left where they are (runtime/native_plan.cpp, WorkersApart)
  OPWEAVE_OPENMP_WAITS   spin (default) | system: where opweave is imported before torch,
                         libgomp loads with OMP_WAIT_POLICY=active GOMP_SPINCOUNT=300000,
                         so a second calling thread's OpenMP threads spin through the gaps
                         between regions; or libgomp is left as it is (openmp_waits.py;
                         read at import, not an Options field)
  OPWEAVE_PRECISION      fp32 (default) | bf16: products, convolutions and attention on
                         bfloat16 operands with float32 accumulation | bf16x3: linear
                         layers and convolutions from three bf16 parts, float32's
                         accuracy | int8 | int8-dynamic (codegen/precision.py, int8.py)
  OPWEAVE_ONEDNN_ROOT    where oneDNN's own library (lib/libdnnl.so.3) and headers are
                         (default: the environment's prefix, where pip puts them; read by
                         codegen/onednn_direct.py, which finds them only when needed)
  OPWEAVE_DEBUG          set: dump the IR after every pass, pass timings, the partition
                         and the generated C++ under OPWEAVE_DEBUG_DIR (default ./opweave_debug)
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Mapping

from .codegen.kernel_schedule import check_mode as check_kernels
from .runtime.allocator import check_mode as check_allocator
from .runtime.native import check_workers
from .passes.rewrite.pipeline import RewriteOptions

FUSION_MODES = ("ilp", "greedy", "off")
DEVICES = ("cpu", "cuda", "auto")
NATIVE_MODES = ("background", "wait", "off")
SCHEDULES = ("sequential", "ios", "critical-path")
PRECISIONS = ("fp32", "bf16", "bf16x3", "int8", "int8-dynamic")


@dataclass(frozen=True)
class Options:
    """What one compile does. Build with `Options.resolve(...)`; derive with `replace`."""

    rewrite: RewriteOptions = field(default_factory=RewriteOptions)
    fusion: str = "ilp"
    # choose between library forms (oneDNN, MKL, reference ops) by timing them here
    measure: bool = True
    # no wall-clock deadline decides anything (saturation, extraction, partition ILP):
    # construction replaces them by work counts in `rewrite` and `partition_seconds`
    deterministic: bool = False
    verify: bool = True               # verify the IR after every pass
    debug_dir: str | None = None      # dump the IR after every pass here
    partition_seconds: float = 2.0    # the fusion ILP's deadline per component
    # where measured choices are recorded and looked up: a path, "default" (the file
    # under opweave's cache directory) or None (measure, remember for the process only)
    tuning_db: str | None = "default"
    # calls replayed by the native plan once recorded and checked (see runtime/native.py):
    # "background" builds its module in a thread, "wait" before the first replay, or "off"
    native: str = "background"
    # compile each graph with the configuration (rewrite, fusion) `opweave tune` recorded
    # for it on this machine, when there is one. On for options built from the
    # environment (what opweave.compile and torch.compile use by default) unless the
    # caller chose rewrite or fusion; off for an `Options(...)` a caller wrote, which
    # says what it wants
    tuned: bool = False
    # a training step's peak memory: bytes (an int) or a fraction of the unconstrained
    # peak (a float in (0, 1]); activations are recomputed to meet it (schedule/remat/)
    memory_budget: int | float | None = None
    # "fp32", or "bf16": products, convolutions and attention computed on bfloat16
    # operands with float32 accumulation, everything else float32; "bf16x3": linear
    # layers and convolutions may compute from three bf16 parts at float32's accuracy
    # (codegen/precision.py); "int8", "int8-dynamic" (codegen/int8.py); inference graphs
    # only: a training step computes in float32
    precision: str = "fp32"
    # where the compiled graph runs: None (where its tensors are: each segment where its
    # example values are), "cpu", "cuda" or "cuda:N" (Triton kernels, docs/gpu.md), or
    # "auto" (each part placed on the CPU or the GPU, schedule/placement.py)
    device: str | None = None
    # "sequential": one step after another, each on every thread; "ios" or
    # "critical-path": independent steps in concurrent stages on shares of the cores
    # (schedule/concurrent.py), on the native plan, kept only when measured faster
    schedule: str = "sequential"
    # the generated C++ kernels' schedules (threads, vector width, unrolling): "recorded"
    # (the tuning database's for this machine, else the default), "default", or "tune"
    # (measured where none is recorded, then recorded; codegen/kernel_schedule.py)
    kernels: str = "recorded"
    # "keep": memory freed between a compiled model's calls stays mapped in the process
    # (no page faults on every call); "system": the C library's own policy
    # (runtime/allocator.py)
    allocator: str = "keep"
    # "apart": the native plan's calls keep the calling thread's OpenMP workers off the
    # caller's CPU (a worker woken onto it waits for the caller to be preempted); "system":
    # they are left where they are (runtime/native_plan.cpp, WorkersApart)
    workers: str = "apart"
    # measure the library forms the tuning database records again, and decide each on its
    # record's samples and the new ones together (a record measured under load is then
    # corrected: noise only adds time); `opweave tune MODEL`'s workers do
    recheck: bool = False

    def __post_init__(self):
        _choice("fusion", self.fusion, FUSION_MODES)
        if self.device is not None and not re.fullmatch(r"cuda:\d+", str(self.device)):
            _choice("device", self.device, DEVICES)
        _check_precision(self.precision)
        _check_budget(self.memory_budget)
        _choice("native", self.native, NATIVE_MODES)
        _choice("schedule", self.schedule, SCHEDULES)
        check_kernels(self.kernels)
        check_allocator(self.allocator)
        check_workers(self.workers)
        if not isinstance(self.rewrite, RewriteOptions):
            raise TypeError(f"rewrite must be RewriteOptions, not {type(self.rewrite).__name__}")
        if self.deterministic and (self.rewrite.limits.seconds != math.inf
                                   or self.partition_seconds != math.inf):
            object.__setattr__(self, "rewrite", self.rewrite.without_deadlines())
            object.__setattr__(self, "partition_seconds", math.inf)

    @classmethod
    def resolve(cls, options: "Options | None" = None, *, rewrite=None, fusion=None,
                memory_budget=None, precision=None, device=None, schedule=None,
                env: Mapping[str, str] | None = None) -> "Options":
        """`options` as given, or built from the environment; `rewrite=` and `fusion=`
        (the keyword arguments of opweave.compile) override either, and then no tuned
        configuration replaces them; so do `memory_budget=`, `precision=`, `device=` and
        `schedule=`."""
        env = os.environ if env is None else env
        if options is None:
            options = cls.from_env(env)
        elif not isinstance(options, Options):
            raise TypeError(f"options must be opweave.Options, not {type(options).__name__}")
        changes = {}
        if rewrite is not None:
            changes["rewrite"] = RewriteOptions.resolve(rewrite)  # deadlines: __post_init__
        if fusion is not None:
            changes["fusion"] = "off" if fusion is False else fusion
        if changes:
            changes["tuned"] = False
        if memory_budget is not None:
            changes["memory_budget"] = memory_budget
        if precision is not None:
            changes["precision"] = precision
        if device is not None:
            changes["device"] = device
        if schedule is not None:
            changes["schedule"] = schedule
        return replace(options, **changes) if changes else options

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        env = os.environ if env is None else env
        debug = env.get("OPWEAVE_DEBUG", "")
        chosen = bool(env.get("OPWEAVE_REWRITE") or env.get("OPWEAVE_FUSION"))
        return cls(rewrite=RewriteOptions.resolve(env.get("OPWEAVE_REWRITE") or "eqsat"),
                   fusion=env.get("OPWEAVE_FUSION", "") or "ilp",
                   measure=_flag(env, "OPWEAVE_MEASURE", True),
                   deterministic=_flag(env, "OPWEAVE_DETERMINISTIC", False),
                   verify=_flag(env, "OPWEAVE_VERIFY", True),
                   tuning_db=_tuning_db(env.get("OPWEAVE_TUNING_DB", "")),
                   native=env.get("OPWEAVE_NATIVE", "").strip().lower() or "background",
                   tuned=_flag(env, "OPWEAVE_TUNED", True) and not chosen,
                   precision=env.get("OPWEAVE_PRECISION", "").strip().lower() or "fp32",
                   schedule=env.get("OPWEAVE_SCHEDULE", "").strip().lower() or "sequential",
                   kernels=env.get("OPWEAVE_KERNELS", "").strip().lower() or "recorded",
                   allocator=env.get("OPWEAVE_ALLOCATOR", "").strip().lower() or "keep",
                   workers=env.get("OPWEAVE_WORKERS", "").strip().lower() or "apart",
                   recheck=_flag(env, "OPWEAVE_RECHECK", False),
                   debug_dir=(env.get("OPWEAVE_DEBUG_DIR") or "opweave_debug")
                   if debug not in ("", "0") else None)


def _tuning_db(text: str) -> str | None:
    if text.strip().lower() in ("off", "0", "none"):
        return None
    return text or "default"


def _check_budget(budget) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"memory_budget must be bytes (an int) or a fraction of the "
                        f"unconstrained peak (a float), not {type(budget).__name__}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, not {budget}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"a fractional memory_budget must be in (0, 1], not {budget}; "
                         "give bytes as an int")


def _check_precision(precision) -> None:
    _choice("precision", precision, PRECISIONS)


def _choice(what: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if text == "":
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name} must be 0 or 1; got {env[name]!r}")


__all__ = ["Options", "RewriteOptions", "FUSION_MODES", "NATIVE_MODES", "PRECISIONS", "DEVICES",
           "SCHEDULES"]
