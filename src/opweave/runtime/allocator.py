"""Keep freed memory in the process for the next call, where the C library is glibc.

torch allocates each op's output with malloc. glibc serves a block above its mmap
threshold with freshly mapped pages and gives memory freed at the top of its heap back to
the system beyond its trim threshold; both thresholds move with the program's history.
A compiled model whose steps allocate and free multi-megabyte tensors then faults its
pages in again on every call: ViT-B/16 took 600-1,800 page faults a call, a few percent of
its time, and a library form measured right after a reference form that freed large
tensors ran 1.7-2x slower than it does (2,300 faults a pair), which skewed measured
choices (AMD EPYC Zen 4, glibc 2.36). With both thresholds fixed high, steady-state calls
take no page faults. What it costs: memory a model freed stays mapped in the process, up
to the heap's high-water mark (blocks below MMAP_THRESHOLD come from the heap, and only
free memory at its top beyond TRIM_THRESHOLD goes back), as the allocators recommended
for torch's CPU inference (jemalloc, tcmalloc) also keep it.

`Options.allocator` ("keep", the default; "system" leaves the C library's policy alone,
`OPWEAVE_ALLOCATOR=system`) decides; the setting is made once per process, at the first
CPU graph a compile with "keep" lowers, and stays for the process; `explain` says so on
the graphs compiled with "keep". Where jemalloc or tcmalloc is preloaded, glibc's malloc
is not the one in use and the setting does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

MODES = ("keep", "system")
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the heap, whose pages stay mapped
TRIM_THRESHOLD = 512 << 20  # free memory at the top of the heap kept up to this


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"allocator must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


@functools.lru_cache(maxsize=None)
def _glibc():
    """glibc's `mallopt`, or None where the C library is another (musl, macOS, Windows:
    their allocators have no such thresholds)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def is_glibc() -> bool:
    return _glibc() is not None


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Set glibc's thresholds (once per process: the setting is process-wide and stays);
    whether they were set. glibc before 2.35 or so refuses an mmap threshold above 32 MiB
    (half its heap size): then that is the threshold."""
    mallopt = _glibc()
    if mallopt is None:
        return False
    mmap_set = any(mallopt(M_MMAP_THRESHOLD, size) for size in (MMAP_THRESHOLD, 32 << 20))
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and mmap_set


def apply(mode: str) -> bool:
    """Keep freed memory if `mode` says so; whether this process keeps it."""
    return check_mode(mode) == "keep" and keep_freed_memory()
