"""Compile generated C++ into shared objects, cached on disk.

An object is keyed by a hash of its source, the compiler's version, the flags and the
CPU's features, so a cache shared between machines never hands one CPU code built for
another. Beside each object `<key>.so` lies `<key>.so.sha256`, its content hash recorded
at build time; an object is loaded only after its bytes match it (a damaged object can
crash the loader itself), and a damaged entry is moved aside to `*.corrupt` and rebuilt.
Each object also exports `ow_key()`, its own key, checked after loading. Builds run in
`.build-<host>-<pid>-*` directories inside the cache and are renamed into place, so a
killed build leaves no half-written entry, and its directory is removed by a later build.
Translation units build in parallel, one compiler process per core.

Flags: -fno-math-errno and -fno-trapping-math let g++ vectorize floor, sqrt and float-to-int
conversions (without them the loops stay scalar); neither changes a computed value, since
opweave reads neither errno nor floating-point traps. -ffast-math, which would, is not used.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import cache_root
from .prelude import PRELUDE

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-fPIC", "-shared", "-std=c++17")
COMPILER = os.environ.get("CXX", "g++")
BUILD_PREFIX = ".build-"  # build directories inside the cache: .build-<host>-<pid>-<random>
STALE_BUILD_SECONDS = 3600
_LOADED: dict[str, ctypes.CDLL] = {}  # key -> object already loaded by this process


class BuildError(RuntimeError):
    """The C++ compiler is missing or rejected generated code."""


# Bumped whenever an entry's format changes: entries of an older format sit in another
# directory and are never looked at (no warnings about them after an upgrade).
CACHE_FORMAT = 2  # 2: every object has a content hash beside it


def cache_dir() -> Path:
    return cache_root() / f"kernels-v{CACHE_FORMAT}"


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


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold the cache directory's lock while an entry is checked, installed or moved aside
    (short steps; compilation runs outside it): a reader never sees an object whose hash
    is still being written, and two builders never replace each other's valid entry.
    A read-only cache cannot change under us: there it goes without the lock."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        handle = open(directory / ".lock", "a")
    except PermissionError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _problem(path: Path) -> str | None:
    """Why the entry at `path` must not be loaded, or None when its bytes match the
    sha256 recorded when it was built. Checked before `ctypes.CDLL`: loading a truncated
    or damaged object can kill the process (SIGBUS, SIGILL) before any check could run."""
    try:
        expected = _sidecar(path).read_text().strip()
    except FileNotFoundError:
        return "has no recorded content hash"
    except (OSError, UnicodeDecodeError) as err:
        return f"has an unreadable content hash ({err})"
    return None if _digest(path) == expected else "does not match its recorded content hash"


def _move_aside(path: Path, problem: str) -> None:
    """Rename a bad entry to `*.corrupt` (kept for inspection) and warn once, naming it."""
    aside = path.with_name(path.name + ".corrupt")
    os.replace(path, aside)
    _sidecar(path).unlink(missing_ok=True)
    warnings.warn(f"opweave: cached kernel object {path} {problem}; moved it to {aside} "
                  f"and rebuilding it", RuntimeWarning, stacklevel=3)


def _trusted(path: Path) -> bool:
    """Whether the entry at `path` exists and is intact; a damaged one is moved aside."""
    with _locked(path.parent):
        if not path.exists():
            return False
        problem = _problem(path)
        if problem is None:
            return True
        _move_aside(path, problem)
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_builds(directory: Path) -> None:
    """Remove build directories that a killed process left: named
    `.build-<host>-<pid>-<random>`, one is stale when its process (on this host) is gone
    or when it is older than STALE_BUILD_SECONDS (another host's, or a reused pid)."""
    host, now = socket.gethostname(), time.time()
    for entry in directory.glob(BUILD_PREFIX + "*"):
        try:
            owner, pid, _ = entry.name[len(BUILD_PREFIX):].rsplit("-", 2)
            stale = ((owner == host and not _alive(int(pid)))
                     or now - entry.stat().st_mtime > STALE_BUILD_SECONDS)
        except (ValueError, OSError):
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def _build_dir(directory: Path) -> tempfile.TemporaryDirectory:
    """A scratch directory in the cache, named so a later build can tell whose it was;
    removed on exit (a killed process leaves it to `_remove_stale_builds`)."""
    prefix = f"{BUILD_PREFIX}{socket.gethostname()}-{os.getpid()}-"
    return tempfile.TemporaryDirectory(prefix=prefix, dir=directory)


def _compile(source: str, target: Path, flags=FLAGS, libraries=()) -> None:
    """Build `source` into `target` and record its hash beside it. The work happens in a
    build directory inside the cache (same file system, so the object is renamed into
    place, never copied); the object goes in first, its hash second, so a crash between
    them leaves an entry without a hash, which is rebuilt, never trusted."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(target.parent)
    with _build_dir(target.parent) as tmp:
        src, out = Path(tmp) / "source.cpp", Path(tmp) / "object.so"
        src.write_text(source)
        proc = subprocess.run([COMPILER, *flags, str(src), "-o", str(out), *libraries],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{COMPILER} failed on generated code:\n{proc.stderr[-4000:]}")
        digest = Path(tmp) / "object.so.sha256"
        digest.write_text(_digest(out) + "\n")
        with _locked(target.parent):
            if target.exists() and _problem(target) is None:
                return  # another process installed a valid entry meanwhile: keep it
            os.replace(out, target)
            os.replace(digest, _sidecar(target))


def trusted_object(source: str, target: Path, flags, libraries=()) -> Path:
    """`target`, built from `source` unless an intact entry is there already (a damaged
    one is moved aside and rebuilt). For objects other than kernels (the native runtime);
    the caller checks the identity of what it loads, as `load` does."""
    if not _trusted(target):
        _compile(source, target, flags, libraries)
    return target


def installed(path: Path) -> bool:
    """Whether an entry and its content hash are both in place (a builder installs the
    object first and its hash second); `trusted_object` still checks the bytes."""
    return path.exists() and _sidecar(path).exists()


def move_aside(path: Path, problem: str) -> None:
    """Move a cache entry that loaded but is not what it should be out of the way."""
    with _locked(path.parent):
        if path.exists():
            _move_aside(path, problem)


def _load_checked(path: Path, key: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(path))
        lib.ow_key.restype = ctypes.c_char_p
        if lib.ow_key().decode() == key:
            return lib
    except (OSError, AttributeError, UnicodeDecodeError):
        pass
    return None


def _load_copy(path: Path, key: str) -> ctypes.CDLL | None:
    """Load a private copy of `path`: the loader matches objects by file name, so after
    it has loaded a wrong object under `path`, loading `path` again would return that."""
    with _build_dir(path.parent) as tmp:
        copy = Path(tmp) / path.name
        shutil.copyfile(path, copy)
        return _load_checked(copy, key)


def load(body: str) -> ctypes.CDLL:
    """The shared object for `body` (C++ function definitions), from cache or built.
    A cached object is loaded only once its bytes match the hash recorded at build time."""
    key = key_of(body)
    if key in _LOADED:
        return _LOADED[key]
    path = cache_dir() / f"{key}.so"
    if not _trusted(path):
        _compile(full_source(body, key), path)
    lib = _load_checked(path, key)
    if lib is None:  # intact bytes, wrong identity: only a planted (object, hash) pair
        move_aside(path, "identifies itself with another key")
        _compile(full_source(body, key), path)
        lib = _load_copy(path, key)
    if lib is None:
        raise BuildError(f"built {path} but it does not load or identify itself")
    _LOADED[key] = lib
    return lib


def helper_functions(body: str, names, what: str, instead: str) -> dict | None:
    """The functions `names` (each `void(void**)`, a generated kernel's signature) of a
    hand-written C++ helper, built once per machine like a kernel; None, with one
    warning naming `what` could not be built and what runs `instead`, where no compiler
    builds it. Their parallel regions take the calling thread's OpenMP count
    (torch.set_num_threads), however it changes after the build."""
    try:
        lib = load(body)
    except BuildError as err:
        warnings.warn(f"opweave: {what} could not be built ({err}); {instead}",
                      RuntimeWarning, stacklevel=3)
        return None
    lib.ow_set_threads(os.cpu_count() or 1)
    found = {}
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        fn.restype = None
        found[name] = fn
    return found


def load_many(bodies: list[str]) -> list[ctypes.CDLL]:
    """Build several translation units in parallel (one compiler process per core)."""
    key_of("")  # fail fast, once, if there is no compiler
    workers = max(1, min(len(bodies), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(load, bodies))
