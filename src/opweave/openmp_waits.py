"""Let a second thread's OpenMP workers spin through the gaps between its regions.

libgomp gives every thread that starts a parallel region a team of its own, and keeps
each team's workers after the region. Once the process has more of them than CPUs (a
model compiled on the main thread and called from a server's thread: two teams, four
threads on a 2-CPU machine), libgomp lets a waiting thread spin only 100 rounds before it
sleeps (its throttled spin count, where it is otherwise 300,000), so each region of a
model called from the second thread waits for a worker's wake: on the 2-vCPU VMs measured,
XML-CNN's bf16 call took 1.0-1.15 ms from a second thread against 0.48-0.50 from the
main one, ResNet-50's 21.8 against 19.9 ms, eager torch's 64K-float add 55-72 us against
7-10. With `OMP_WAIT_POLICY=active` and `GOMP_SPINCOUNT=300000` libgomp spins 1,000
rounds then and its usual 300,000 otherwise, so nothing changes for a single calling
thread and the second thread's calls ran as fast as the main thread's (docs/runtime.md).

libgomp reads its environment once, when it is loaded, which is when torch is imported.
So `import opweave` sets the two variables only where it comes first: torch is not yet
imported, torch's own wheel carries the libgomp it loads (a torch built with another
OpenMP runtime reads `OMP_WAIT_POLICY=active` as "never sleep"), Linux, and the user set
neither variable. Once torch has been imported, whenever that is (the program may still
set OMP_NUM_THREADS or the like between the two imports, as the bench's workers do; where
it set either of the two, its choice alone reaches libgomp), the environment is put back
as it was, so no child process inherits the setting.
`OPWEAVE_OPENMP_WAITS=system` leaves libgomp as it is. An environment variable, not an
`Options` field: the choice is made before any compile, once per process. Where torch was
imported first, setting the two variables before the process starts does the same, and
the first compiled call from a thread other than the main one says so once (an
`OpweavePerformanceWarning`) where two teams of torch's size would not fit on the CPUs.
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

_applied = False
MAIN_THREAD = threading.main_thread().ident
# whether a compiled call from a thread other than the main one is still to be checked
# for the throttled waits (`second_thread_called`); the executor reads it on every call
watching = True


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def applied() -> bool:
    """Whether this process's libgomp was loaded with the settings above."""
    return _applied


def _torch_bundles_libgomp() -> bool:
    """Whether the torch to be imported carries its own libgomp (a pip wheel), found
    without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = spec.submodule_search_locations[0]
    return any(glob.glob(os.path.join(where, "libgomp*.so*"))
               for where in (os.path.join(package, "lib"), package + ".libs"))


def before_torch() -> bool:
    """Set the variables for torch's import where the conditions above hold; whether it
    did."""
    mode = check_mode(os.environ.get(ENV, "spin"))
    if (mode != "spin" or "torch" in sys.modules or not sys.platform.startswith("linux")
            or any(name in os.environ for name in SETTINGS)
            or not _torch_bundles_libgomp()):
        return False
    os.environ.update(SETTINGS)
    sys.meta_path.insert(0, _RestoreAfterTorch())
    return True


def _restore() -> None:
    for name, value in SETTINGS.items():
        if os.environ.get(name) == value:  # not a value the program set since
            del os.environ[name]


class _RestoreAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing of its own: hands torch's import to the other finders and puts the
    environment back once torch, and libgomp with it, has loaded (or failed to)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            _restore()
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            global _applied
            _applied = all(os.environ.get(k) == v for k, v in SETTINGS.items())
            if not _applied:  # the program set one of them since: its choice alone counts
                _restore()
            try:
                load(module)
            finally:
                _restore()

        spec.loader.exec_module = exec_module
        return spec


def second_thread_called() -> None:
    """A native plan was called from a thread other than the main one. Where libgomp runs
    with its own waits and a second team makes more OpenMP threads than CPUs (the main
    thread's team stays once it ran torch's parallel operators: building or compiling a
    model does), say once what to set, before the process starts. Checked once."""
    global watching
    watching = False
    if _applied or not sys.platform.startswith("linux") or not _torch_bundles_libgomp() \
            or os.environ.get(ENV, "spin") != "spin" \
            or any(name in os.environ for name in SETTINGS):
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
