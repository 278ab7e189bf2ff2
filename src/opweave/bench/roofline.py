"""The roofline's two numbers: a model's FLOPs (from the IR's cost formulas) and the
machine's fp32 GEMM peak (measured once per machine and thread count, then cached)."""
from __future__ import annotations

import json
import os
import platform
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Callable

from ..files import atomic_write_bytes, cache_root
from .worker import INFER

CACHE_FILE = "gemm_peak.json"
GEMM_SIZES = (512, 1024, 2048)
CALIBRATION_VERSION = 2  # part of the cache key: a new method never reads old figures


def cache_dir() -> Path:
    return cache_root()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(threads: int) -> str:
    return (f"v{CALIBRATION_VERSION}|{cpu_name()}|{os.cpu_count()} cpus|{threads} threads|"
            f"torch {metadata.version('torch')}")


def measure_gemm_peak(sizes=GEMM_SIZES, seconds_per_size: float = 0.5) -> float:
    """Best FLOP/s of square fp32 `torch.mm` over `sizes` and repetitions, with the current
    threads. The fastest run, not the median: a peak is what the machine can reach, and
    interference only ever slows a run down."""
    import torch

    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up: pools, page faults
        samples, deadline = [], time.perf_counter() + seconds_per_size
        while len(samples) < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            samples.append(time.perf_counter() - start)
        best = max(best, 2 * n ** 3 / min(samples))
    return best


def gemm_peak(threads: int, measure: Callable[[], float]) -> tuple[float, bool]:
    """The cached GEMM peak for this machine and thread count, measuring (with `measure`)
    and caching it on a miss. Returns (FLOP/s, whether it came from the cache). A corrupted
    cache file is reported, then replaced."""
    path = cache_dir() / CACHE_FILE
    key = calibration_key(threads)
    entries: dict = {}
    if path.exists():
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
            value = entries.get(key)
            if value is not None:
                if not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"entry {key!r} is {value!r}, not a positive number")
                return float(value), True
        except ValueError as error:
            warnings.warn(f"ignoring corrupted GEMM-peak cache {path}: {error}; recalibrating",
                          stacklevel=2)
            entries = {}
    value = measure()
    entries[key] = value
    atomic_write_bytes(path, json.dumps(entries, indent=1, sort_keys=True).encode())
    return value, False


def model_flops(bench, mode: str) -> float:
    """FLOPs of one inference or one training step (forward + backward graphs), summed
    from the IR cost formulas of the graphs opweave captures."""
    import copy

    import torch

    from ..frontends import torch_dynamo
    from ..frontends.torch_export import compile as opweave_compile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == INFER:
            graphs = opweave_compile(bench.module.eval(), bench.inputs, name=bench.name).graphs
        else:
            from ..models.base import disable_dropout

            loss_module = disable_dropout(copy.deepcopy(bench.loss_module).train())
            before = len(torch_dynamo.compiled_graphs)
            torch._dynamo.reset()
            torch.compile(loss_module, backend="opweave")(*bench.inputs, bench.targets).backward()
            graphs = [g for program in torch_dynamo.compiled_graphs[before:]
                      for g in program.graphs]
    return float(sum(graph.cost().flops for graph in graphs))
