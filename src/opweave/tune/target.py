"""The machine a measurement was taken on: the part of it that decides which kernel form
wins (CPU model, vector and matrix ISA, cores, threads, library versions). Records are
keyed by its hash; a record of another target is never taken as a measurement here."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform

# ISA features that change which GEMM/convolution form is fastest
_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8", "asimd", "sve")


@functools.lru_cache(maxsize=None)
def _cpu() -> tuple[str, tuple[str, ...]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, tuple(f for f in _FEATURES if f in flags)


def describe(threads: int | None = None) -> dict:
    """This process's target, as a JSON-able dict."""
    import torch

    model, features = _cpu()
    return {
        "cpu": model,
        "features": list(features),
        "cores": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        # torch's version fixes the oneDNN and MKL it bundles; its capability is the
        # vector ISA its kernels dispatch to here
        "torch": torch.__version__,
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
        **_onednn(),
    }


@functools.lru_cache(maxsize=None)
def _onednn() -> dict:
    """The version of oneDNN's own library that convolutions and linear layers may call
    directly (codegen/onednn_direct.py), where it is installed."""
    try:
        return {"onednn": importlib.metadata.version("onednn-cpu-gomp")}
    except importlib.metadata.PackageNotFoundError:
        return {}


def target_id(descriptor: dict) -> str:
    text = json.dumps(descriptor, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
