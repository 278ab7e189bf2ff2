"""Compile generated C++ into shared objects, cached on disk.

An object is keyed by a hash of its source, the compiler's version, the flags and the
CPU's features, so a cache shared between machines never hands one CPU code built for
another. Each object exports `ow_key()`, its own key; an entry that does not load or
whose key does not match is rebuilt, never trusted. Objects are written to a temporary
name and renamed into place, so a killed build leaves no half-written entry. Translation
units build in parallel, one compiler process per core.

Flags: -fno-math-errno and -fno-trapping-math let g++ vectorize floor, sqrt and float-to-int
conversions (without them the loops stay scalar); neither changes a computed value, since
opweave reads neither errno nor floating-point traps. -ffast-math, which would, is not used.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import atomic_write, cache_root
from .prelude import PRELUDE

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-fPIC", "-shared", "-std=c++17")
COMPILER = os.environ.get("CXX", "g++")
_LOADED: dict[str, ctypes.CDLL] = {}  # key -> object already loaded by this process


class BuildError(RuntimeError):
    """The C++ compiler is missing or rejected generated code."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


@functools.lru_cache(maxsize=None)
def compiler_version() -> str:
    try:
        out = subprocess.run([COMPILER, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise BuildError(f"no working C++ compiler ({COMPILER}): {err}") from None
    return out.stdout.splitlines()[0]


@functools.lru_cache(maxsize=None)
def cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    import platform
    return platform.machine() + platform.processor()


def key_of(source: str) -> str:
    parts = [source, compiler_version(), " ".join(FLAGS), cpu_features()]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


def full_source(body: str, key: str) -> str:
    return PRELUDE + body + f'\nextern "C" const char* ow_key() {{ return "{key}"; }}\n'


def _compile(source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="opweave-build-") as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        out = Path(tmp) / "kernels.so"
        proc = subprocess.run([COMPILER, *FLAGS, str(src), "-o", str(out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{COMPILER} failed on generated code:\n{proc.stderr[-4000:]}")
        atomic_write(target, lambda staged: shutil.copyfile(out, staged))


def _load_checked(path: Path, key: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        lib.ow_key.restype = ctypes.c_char_p
        if lib.ow_key().decode() == key:
            return lib
    except (OSError, AttributeError, UnicodeDecodeError):
        pass
    return None


def load(body: str) -> ctypes.CDLL:
    """The shared object for `body` (C++ function definitions), from cache or built."""
    key = key_of(body)
    if key in _LOADED:
        return _LOADED[key]
    path = cache_dir() / f"{key}.so"
    stale = False
    if path.exists():
        lib = _load_checked(path, key)
        if lib is not None:
            _LOADED[key] = lib
            return lib
        warnings.warn(f"opweave: cached kernel object {path} failed its check; rebuilding it",
                      RuntimeWarning, stacklevel=2)
        stale = True
    _compile(full_source(body, key), path)
    if stale:  # the loader may hold the bad file under this name: load a private copy
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so", delete=False) as f:
            copy = Path(f.name)
        shutil.copyfile(path, copy)
        lib = _load_checked(copy, key)
        copy.unlink(missing_ok=True)
    else:
        lib = _load_checked(path, key)
    if lib is None:
        raise BuildError(f"built {path} but it does not load or identify itself")
    _LOADED[key] = lib
    return lib


def load_many(bodies: list[str]) -> list[ctypes.CDLL]:
    """Build several translation units in parallel (one compiler process per core)."""
    key_of("")  # fail fast, once, if there is no compiler
    workers = max(1, min(len(bodies), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(load, bodies))
