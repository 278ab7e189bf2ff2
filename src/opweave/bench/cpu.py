"""Which CPU a benchmark ran on, for the report: a figure means little without the model,
the vector and matrix ISA its kernels could use, and how many cores and threads it had.

Reuses the tuning database's target description (`opweave.tune.target`), adding the
physical core count and the CPU's family/model numbers (some VMs name the model only
"AMD EPYC", which the family and model numbers pin down to a generation).
"""
from __future__ import annotations

import os

from ..tune import target


def _cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return []
    blocks = []
    for block in text.strip().split("\n\n"):
        entry = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            entry[key.strip()] = value.strip()
        blocks.append(entry)
    return blocks


def physical_cores(blocks: list[dict[str, str]]) -> int | None:
    """Distinct (package, core) pairs; None where /proc/cpuinfo does not say."""
    pairs = {(b.get("physical id"), b.get("core id")) for b in blocks if "core id" in b}
    return len(pairs) or None


def describe(threads: int) -> dict:
    """The CPU as a JSON-able dict: `opweave.tune.target.describe` plus `physical_cores`,
    `logical_cpus` and `cpu_id` (vendor, family, model, stepping)."""
    info = target.describe(threads)
    blocks = _cpuinfo()
    first = blocks[0] if blocks else {}
    ids = [f"{key} {first[key]}" for key in ("cpu family", "model", "stepping") if key in first]
    info.update(logical_cpus=os.cpu_count(), physical_cores=physical_cores(blocks),
                cpu_id=" ".join(filter(None, [first.get("vendor_id"), *ids])))
    return info


def line(cpu: dict) -> str:
    """One line for a report header, e.g. `CPU: AMD EPYC (AuthenticAMD cpu family 25 model 1
    stepping 1); ISA avx2 fma (torch kernels: AVX2); 2 cores, 2 logical CPUs; 2 threads`."""
    name = cpu.get("cpu") or "unknown CPU"
    if cpu.get("cpu_id"):
        name += f" ({cpu['cpu_id']})"
    features = " ".join(cpu.get("features") or []) or "none of avx2/avx512/amx"
    isa = f"ISA {features}"
    if cpu.get("torch_isa"):
        isa += f" (torch kernels: {cpu['torch_isa']})"
    cores = cpu.get("physical_cores")
    counts = (f"{cores} cores, " if cores else "") + f"{cpu.get('logical_cpus')} logical CPUs"
    threads = cpu.get("threads")
    return f"CPU: {name}; {isa}; {counts}; {threads} thread{'s' * (threads != 1)}"
