"""The roofline's parameters, measured on this machine rather than assumed: the fp32 GEMM
peak, the streaming bandwidth out of DRAM and out of cache, the cache sizes the system
reports, and the cost of one dispatched op. `opweave tune machine` measures them once and
stores them in the tuning database (tune/roofline.py); compiles then cost graphs with them.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from .model import Machine

CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
_UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def cache_sizes(root: str | os.PathLike = CACHE_DIR) -> dict[str, int]:
    """Bytes of each cache level of CPU 0 as sysfs reports them: {"L1d", "L1i", "L2",
    "L3"} (those present); empty where the system does not say."""
    sizes: dict[str, int] = {}
    for index in sorted(Path(root).glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if not text:
            continue
        scale = _UNITS.get(text[-1].upper(), 1)
        digits = text[:-1] if text[-1].upper() in _UNITS else text
        if not digits.isdigit():
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        sizes[f"L{level}{suffix}"] = int(digits) * scale
    return sizes


def measure_gemm_peak(sizes=(512, 1024, 2048), seconds_per_size: float = 0.5) -> float:
    """Best FLOP/s of square fp32 `torch.mm` over `sizes` and repetitions, with the current
    threads. The fastest run, not the median: a peak is what the machine can reach, and
    interference only ever slows a run down."""
    import torch

    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        torch.mm(a, b, out=out)  # warm-up: pools, page faults
        best = max(best, 2 * n ** 3 / _fastest(lambda: torch.mm(a, b, out=out), seconds_per_size))
    return best


def measure_bandwidth(nbytes: int, seconds: float = 0.3) -> float:
    """Bytes/s moved by the fastest copy of an fp32 buffer of `nbytes` (read + write), with
    the current threads: streaming from DRAM when it is much larger than the caches, from
    cache when it fits."""
    import torch

    src = torch.randn(max(nbytes // 4, 1))
    dst = torch.empty_like(src)
    dst.copy_(src)  # page faults
    return 2 * src.numel() * 4 / _fastest(lambda: dst.copy_(src), seconds)


def measure_launch(seconds: float = 0.2, batch: int = 200) -> float:
    """Seconds of one dispatched op that does next to no work (a one-element add into a
    preallocated output): what every kernel pays beyond its arithmetic and traffic."""
    import torch

    a, b, out = torch.ones(1), torch.ones(1), torch.empty(1)

    def many():
        for _ in range(batch):
            torch.add(a, b, out=out)
    return _fastest(many, seconds) / batch


def _fastest(fn, seconds: float) -> float:
    samples, deadline = [], time.perf_counter() + seconds
    while len(samples) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)


def measure(threads: int | None = None, quick: bool = False) -> tuple[Machine, dict]:
    """This machine's roofline parameters with `threads` (default: torch's), and what
    they came from. Data in cache: half of the L2 of each thread's core; from DRAM: four
    times the last-level cache (at least 64 MiB). `quick`: smaller, shorter measurements
    (for tests)."""
    import torch

    threads = threads or torch.get_num_threads()
    caches = cache_sizes()
    l2 = caches.get("L2", 256 * 1024)
    last = max([v for k, v in caches.items() if k not in ("L1i",)] or [8 * 1024 ** 2])
    scale = 0.1 if quick else 1.0
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = measure_gemm_peak((256,) if quick else (512, 1024, 2048), 0.5 * scale)
        in_cache = max(l2 * threads // 2, 4096)
        cache_bw = measure_bandwidth(in_cache, 0.3 * scale)
        dram_bw = measure_bandwidth((1 if quick else 4) * max(last, 16 * 1024 ** 2), 0.3 * scale)
        launch = measure_launch(0.2 * scale)
    finally:
        torch.set_num_threads(old)
    machine = Machine(flops=flops, bandwidth=dram_bw, launch=launch,
                      cache_bytes=in_cache, cache_bandwidth=max(cache_bw, dram_bw))
    return machine, {"threads": threads, "caches": caches}
