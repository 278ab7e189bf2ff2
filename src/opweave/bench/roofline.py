"""The roofline's two numbers: a model's FLOPs (from the IR's cost formulas) and the
machine's fp32 GEMM peak (measured once per machine and thread count, then cached in a
JSON file that records the sha256 of its entries, so a damaged figure is never used)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from importlib import metadata
from pathlib import Path
from typing import Callable

from ..files import atomic_write_bytes, cache_root
from .modes import INFER

# the format in the name: a file of an older format is never read (and never warned about)
CACHE_FILE = "gemm_peak-v2.json"
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


def _digest(entries: dict) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, allow_nan=False).encode()).hexdigest()


def _refuse_constant(name: str):
    raise ValueError(f"holds {name}, not a number")


def _check_peak(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"entry {key!r} is {value!r}, not a finite positive FLOP/s figure")
    return float(value)


def _read_entries(path: Path) -> dict:
    """The entries of the cache file at `path`, once its content matches the sha256
    recorded in it and every figure is a finite positive number; else ValueError."""
    data = json.loads(path.read_text(), parse_constant=_refuse_constant)
    if not isinstance(data, dict) or set(data) != {"sha256", "entries"} \
            or not isinstance(data["entries"], dict):
        raise ValueError("not a GEMM-peak cache with a content hash "
                         "(an object with 'sha256' and 'entries')")
    entries = data["entries"]
    if _digest(entries) != data["sha256"]:
        raise ValueError("its entries do not match their recorded sha256")
    for key, value in entries.items():
        _check_peak(key, value)
    return entries


def gemm_peak(threads: int, measure: Callable[[], float]) -> tuple[float, bool]:
    """The cached GEMM peak for this machine and thread count, measuring (with `measure`)
    and caching it on a miss. Returns (FLOP/s, whether it came from the cache). A damaged
    cache file (bad JSON, a hash that does not match, a figure that is not a finite
    positive number) is reported, moved aside to `*.corrupt`, and measured anew."""
    path = cache_dir() / CACHE_FILE
    key = calibration_key(threads)
    entries: dict = {}
    if path.exists():
        try:
            entries = _read_entries(path)
            if key in entries:
                return float(entries[key]), True
        except ValueError as error:
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            warnings.warn(f"ignoring corrupted GEMM-peak cache {path}: {error}; moved it to "
                          f"{aside}; recalibrating", stacklevel=2)
            entries = {}
    value = _check_peak(key, measure())
    entries[key] = value
    payload = {"sha256": _digest(entries), "entries": entries}
    atomic_write_bytes(path, json.dumps(payload, indent=1, sort_keys=True, allow_nan=False).encode())
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
            before = torch_dynamo.compiled_graphs.mark()
            torch._dynamo.reset()
            torch.compile(loss_module, backend="opweave")(*bench.inputs, bench.targets).backward()
            graphs = [g for program in torch_dynamo.compiled_graphs.since(before)
                      for g in program.graphs]
    return float(sum(graph.cost().flops for graph in graphs))
