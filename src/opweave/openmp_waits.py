"""Let a second thread's OpenMP workers spin through the gaps between its regions.

libgomp gives every thread that starts a parallel region a team of its own and keeps its
workers afterwards. Once the process has more of them than CPUs (a model compiled on the
main thread, whose team stays, and called from a server's thread: four threads on two
CPUs), libgomp lets a waiting thread spin 100 rounds instead of 300,000 before it sleeps,
so each region of a call from the second thread waits for a wake: XML-CNN's bf16 call
took about twice as long as from the main thread, ResNet-50's 10% longer
(docs/runtime.md, "Calls from a second thread"). With `OMP_WAIT_POLICY=active` and
`GOMP_SPINCOUNT=300000` libgomp spins 1,000 rounds there and its usual 300,000
otherwise, and the second thread's calls ran as fast as the main thread's.

libgomp reads its environment once, when torch's import loads it. So `import opweave`
sets the two variables only where it comes first: torch not yet imported, torch's wheel
carrying its own libgomp (another OpenMP runtime reads `active` as "never sleep"),
Linux, and neither variable set. Whatever the program sets before it imports torch
counts too (OMP_NUM_THREADS, as the bench's workers set it; either of the two, and then
its choice alone reaches libgomp), and once torch has loaded, the two are taken out of
the environment again. Until then they are in it: a child process started, or another
OpenMP runtime loaded, between the two imports reads them. `OPWEAVE_OPENMP_WAITS=system`
leaves libgomp as it is; it is read here, at import, not as an `Options` field.

Where torch came first, the first native-plan call from a thread other than the main
one warns once (`second_thread_called`) unless two teams of torch's size fit on the
CPUs: a heuristic, since which threads hold teams is libgomp's to know.
"""
from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys
import threading

from .notices import OpweavePerformanceWarning, warn_once

MODES = ("spin", "system")
ENV = "OPWEAVE_OPENMP_WAITS"
# libgomp's own spin count where OMP_WAIT_POLICY is unset: set with "active" so that only
# the throttled count changes (100 to 1,000 rounds)
SETTINGS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}
MAIN_THREAD = threading.main_thread().ident

_applied = False
# whether a native-plan call from a thread other than the main one is still to be checked
# (`second_thread_called`); the executor reads it on every call
watching = True


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def applied() -> bool:
    """Whether this process's libgomp was loaded with the settings above."""
    return _applied


def _mode() -> str:
    """OPWEAVE_OPENMP_WAITS as the other OPWEAVE_* variables are read; a value it does not
    know leaves libgomp alone, with a warning (at import, no error can be caught)."""
    mode = os.environ.get(ENV, "").strip().lower() or "spin"
    try:
        return check_mode(mode)
    except ValueError as error:
        warn_once(f"opweave: {error}: libgomp is left as it is", RuntimeWarning)
        return "system"


def _torch_bundles_libgomp() -> bool:
    """Whether the torch to be imported carries its own libgomp (a pip wheel), found
    without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = spec.submodule_search_locations[0]
    return any(glob.glob(os.path.join(where, "libgomp*.so*"))
               for where in (os.path.join(package, "lib"), package + ".libs"))


def _could_matter() -> bool:
    return (_mode() == "spin" and sys.platform.startswith("linux")
            and not any(name in os.environ for name in SETTINGS)
            and _torch_bundles_libgomp())


def before_torch() -> bool:
    """Set the variables for torch's import where the conditions above hold; whether it
    did. Where they can never matter, calls stop watching for a second thread."""
    global watching
    if not _could_matter():
        watching = False
        return False
    if "torch" in sys.modules:
        return False
    os.environ.update(SETTINGS)
    sys.meta_path.insert(0, _RestoreAfterTorch())
    return True


def _restore() -> None:
    for name, value in SETTINGS.items():
        if os.environ.get(name) == value:  # ours, or the same value set since
            del os.environ[name]


class _RestoreAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing of its own: asks the finders after it for torch and wraps the
    loader of what they find, so that the environment is put back once torch, and
    libgomp with it, has loaded (or failed to). A spec asked for without an import
    (`importlib.util.find_spec`) is wrapped too and never run; the finder stays until a
    wrapped loader runs."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        loader, load = spec.loader, spec.loader.exec_module

        def exec_module(module):
            global _applied, watching
            if module.__name__ != "torch":  # a loader shared with torch's submodules
                return load(module)
            try:
                sys.meta_path.remove(self)
            except ValueError:  # another wrapped loader ran first
                pass
            ours = all(os.environ.get(k) == v for k, v in SETTINGS.items())
            if not ours:  # the program set one of them since: its choice alone counts
                _restore()
            try:
                load(module)
                _applied = ours
                watching = watching and not ours
            finally:
                _restore()
                del loader.exec_module  # the loader's own again

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):  # a loader that takes no attributes: give up
            sys.meta_path.remove(self)
            _restore()
        return spec


def second_thread_called() -> None:
    """A native plan was called from a thread other than the main one. Where libgomp runs
    with its own waits and a second team makes more OpenMP threads than CPUs, say once
    what to set, before the process starts. Checked once."""
    global watching
    watching = False
    if _applied or not _could_matter():
        return
    import torch

    if 2 * torch.get_num_threads() - 1 <= len(os.sched_getaffinity(0)):
        return  # two teams fit on the CPUs: libgomp does not throttle
    warn_once("opweave: a compiled model is called from a thread other than the main one. "
              "Where the main thread has run torch's parallel operators (building or "
              "compiling the model does), the process then has more OpenMP threads than "
              "CPUs and libgomp lets them sleep between parallel regions: such calls "
              "measured 1.1-2x slower (docs/runtime.md). Start Python with "
              "OMP_WAIT_POLICY=active GOMP_SPINCOUNT=300000, or import opweave before "
              f"torch; {ENV}=system silences this.", OpweavePerformanceWarning, stacklevel=4)
