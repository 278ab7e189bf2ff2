"""Schedules of the generated C++ kernels, measured per machine and remembered.

A kernel's loops are fixed by its group (codegen/render.py); how they map onto the
machine is its schedule: whether its row loop runs on the thread team or on one thread
(a fixed threshold of PARALLEL_MIN elements by default: a parallel region costs about a
microsecond to enter, which small kernels cannot repay, and where that line lies depends
on the machine), the vector width the compiler prefers (GCC's choice for `-march=native`
differs by CPU: 512 bits on some AVX-512 parts, 256 on others), and whether its loops
are unrolled. None of these changes what is computed, only float rounding: a wider
vector splits a row's sum over more lanes, and a column sum's partial sums follow the
thread count.

`choose` picks each pending kernel's schedule when a graph is lowered, by `Options.kernels`:
"recorded" (default) takes the schedule the tuning database holds for the kernel on this
machine, else the default; "default" ignores the records; "tune" measures every
schedule of the kernels without a record (built together, timed interleaved on random
inputs, the default kept unless another is MARGIN faster) and records the winner; each
kernel's choice is also kept for the process. Tuning
is asked for by `opweave tune MODEL` (autotune/search.py), in a worker process; a
compile never measures kernels unless told to.
"""
from __future__ import annotations

import ctypes
import itertools
import sqlite3
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .. import tune
from ..ir.graph import Value
from ..notices import warn_once
from ..tune.db import TuningDBError, TuningDBWarning
from ..tune.target import describe, target_id
from . import build
from .render import KernelSource

KIND = "kernel-schedule"  # the tuning database's name for this decision
MODES = ("recorded", "default", "tune")  # Options.kernels
MARGIN = 0.03  # a schedule replaces the default only when it measured this much faster
ROUNDS = 7
SAMPLE_SECONDS = 2e-4  # a timed sample repeats a short kernel until it lasts about this


@dataclass(frozen=True)
class KernelSchedule:
    threads: str = "auto"  # "auto": the team from PARALLEL_MIN elements; "one"; "team"
    vector: int = 0        # preferred vector width in bits; 0: the compiler's choice
    unroll: bool = False   # unroll the loops (GCC's -funroll-loops for this function)

    def describe(self) -> str:
        return (f"threads={self.threads} vector={self.vector or 'auto'}"
                + (" unroll" if self.unroll else ""))

    def attributes(self) -> str:
        """The function attributes that carry the schedule's compiler choices."""
        parts = []
        if self.vector:
            parts.append(f'__attribute__((target("prefer-vector-width={self.vector}")))')
        if self.unroll:
            parts.append('__attribute__((optimize("unroll-loops")))')
        return "".join(p + " " for p in parts)


DEFAULT = KernelSchedule()


def space() -> list[KernelSchedule]:
    """The schedules worth measuring on this machine (wider vectors only where the
    CPU has AVX-512); the default first."""
    widths = (0, 256, 512) if "avx512f" in describe()["features"] else (0,)
    return [KernelSchedule(t, v, u) for t, v, u in
            itertools.product(("auto", "one", "team"), widths, (False, True))]


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def workload_key(src: KernelSource) -> tuple:
    """What a kernel's best schedule depends on besides the machine: its default source
    (named by its hash), what it computes over which shape, and the compiler."""
    shapes = ", ".join(str(v.type) for v in [*src.outputs, *src.inputs])
    return ("kernel", src.name, shapes, build.compiler_version())


Rerender = Callable[[KernelSchedule], KernelSource]


_CHOSEN: dict[tuple, str] = {}  # (workload key, target) -> form: this process's choices


def _memo_key(src: KernelSource) -> tuple:
    return workload_key(src), target_id(describe())


def choose(pending: list[tuple[KernelSource, Rerender | None]], mode: str) -> list[KernelSource]:
    """Each pending kernel's source under its chosen schedule (see the module's doc);
    kernels without a `Rerender` (templates) keep their default. A database that cannot
    be read counts as holding no record (a warning says so once)."""
    check_mode(mode)
    chosen = [src for src, _ in pending]
    if mode == "default":
        return chosen
    by_form = {s.describe(): s for s in space()}
    kernels: dict[str, tuple[list[int], KernelSource, Rerender]] = {}
    for i, (src, rerender) in enumerate(pending):
        if rerender is not None:
            kernels.setdefault(src.name, ([], src, rerender))[0].append(i)
    untuned = []
    for indices, src, rerender in kernels.values():
        form = _recalled(src, by_form)
        if form is None and mode == "tune":
            untuned.append((indices, src, rerender))
        elif form is not None and by_form[form] != DEFAULT:
            variant = rerender(by_form[form])
            for i in indices:
                chosen[i] = variant
    if untuned:
        winners = _measure_all([(src, rerender) for _, src, rerender in untuned])
        for (indices, _, _), winner in zip(untuned, winners):
            for i in indices:
                chosen[i] = winner
    return chosen


def _recalled(src: KernelSource, by_form: dict) -> str | None:
    """The form chosen for `src` in this process or recorded for this machine, if any."""
    key = _memo_key(src)
    if key not in _CHOSEN:
        try:
            recalled = tune.recall(KIND, key[0], by_form)
        except (OSError, sqlite3.Error, TuningDBError) as err:
            warn_once(f"opweave: the tuning database could not be read ({err}), so the "
                      "generated kernels keep their default schedules", TuningDBWarning)
            recalled = None
        if recalled is None:
            return None
        _CHOSEN[key] = recalled[0]
    return _CHOSEN[key]


def _remember(src: KernelSource, form: str, samples: dict[str, list[float]]) -> None:
    _CHOSEN[_memo_key(src)] = form
    try:
        tune.remember(KIND, workload_key(src), form, samples)
    except (OSError, sqlite3.Error, TuningDBError) as err:
        warn_once(f"opweave: the tuning database could not be written ({err}); the "
                  "kernels' measured schedules hold for this process only", TuningDBWarning)


def _measure_all(kernels: list[tuple[KernelSource, Rerender]]) -> list[KernelSource]:
    """Build every schedule of every kernel together, time each kernel's schedules
    interleaved on random inputs, record and return each kernel's winner."""
    variants = [{s.describe(): (src if s == DEFAULT else rerender(s)) for s in space()}
                for src, rerender in kernels]
    try:
        functions = build_functions([v for forms in variants for v in forms.values()])
    except build.BuildError as err:  # a compiler that refuses a schedule's attributes
        warn_once(f"opweave: the kernels' schedules could not be built, so they keep the "
                  f"default ones: {err}", RuntimeWarning)
        for src, _ in kernels:  # not tried again in this process
            _CHOSEN[_memo_key(src)] = DEFAULT.describe()
        return [src for src, _ in kernels]
    winners = []
    for (src, _), forms in zip(kernels, variants):
        samples = _time(forms, functions)
        best = min(samples, key=lambda f: min(samples[f]))
        if min(samples[best]) > (1 - MARGIN) * min(samples[DEFAULT.describe()]):
            best = DEFAULT.describe()
        _remember(src, best, samples)
        winners.append(forms[best])
    return winners


def build_functions(sources: list[KernelSource], per_unit: int = 16) -> dict[str, Callable]:
    """Every function of `sources` (each kernel and its variants: channels-last, bf16), built in
    translation units of `per_unit` kernels, in parallel; raises build.BuildError."""
    unique = {s.name: s for s in sources}
    names = list(unique)
    units = [names[i:i + per_unit] for i in range(0, len(names), per_unit)]
    libs = build.load_many(["\n".join(unique[n].body for n in unit) for unit in units])
    functions = {}
    for unit, lib in zip(units, libs):
        lib.ow_set_threads(torch.get_num_threads())
        for n in unit:
            for name in unique[n].function_names():
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                fn.restype = None
                functions[name] = fn
    return functions


def _example(v: Value) -> torch.Tensor:
    if v.type.dtype == torch.bool:
        return torch.rand(v.type.shape) < 0.5
    return torch.randn(v.type.shape, dtype=v.type.dtype)


def _time(forms: dict[str, KernelSource], functions) -> dict[str, list[float]]:
    """Seconds per call of each form, ROUNDS interleaved samples (each round in another
    order) after a warm-up round, on the same random inputs; a sample repeats the call
    until it lasts about SAMPLE_SECONDS, the count set from the warmed-up default."""
    first = next(iter(forms.values()))
    outs = [torch.empty(v.type.shape, dtype=v.type.dtype) for v in first.outputs]
    ins = [_example(v) for v in first.inputs]
    argv = (ctypes.c_void_p * (len(outs) + len(ins)))(*[t.data_ptr() for t in [*outs, *ins]])
    calls = [(form, functions[src.name]) for form, src in forms.items()]
    for _, fn in calls:  # warm-up: code, data and the thread team
        fn(argv)
    start = time.perf_counter()
    calls[0][1](argv)
    repeat = max(1, min(1000, int(SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-7))))
    samples: dict[str, list[float]] = {form: [] for form, _ in calls}
    for r in range(ROUNDS):
        shift = r % len(calls)
        for form, fn in calls[shift:] + calls[:shift]:
            start = time.perf_counter()
            for _ in range(repeat):
                fn(argv)
            samples[form].append((time.perf_counter() - start) / repeat)
    return samples
