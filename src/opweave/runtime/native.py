"""The native execution plan: a compiled graph's call replayed in C++, with no Python step
per operator.

An `Executor` runs its steps in Python for its first calls. At the second call it records
what those steps did (`Recorder`): every operator they reached in PyTorch's dispatcher,
with its arguments, and every generated kernel, with the tensors it was handed. The record
becomes a `Plan` of the C++ module `native_plan.cpp`: boxed operator calls and raw kernel
calls over numbered slots, each slot dropped after its last use. At the third call the
plan runs beside the Python steps, and only if both give the same outputs does it take
over; from then on a call is one C++ call, which first checks that the inputs have the
recorded sizes, strides, dtypes and device (every decision the Python steps made depends
on nothing else) and otherwise hands the call back to the Python steps.

What cannot be replayed keeps the Python steps, with the reason kept in
`NativeState.reason` (and shown by `explain`): a step that reads a tensor's value into
Python (`.item()`, a comparison deciding a branch), an operator without a boxed kernel, or
a record whose replay disagrees with Python.

The module is built once per machine and torch version (about 40 s; cached like the
kernels, its content hash checked before it is loaded). `Options.native`: "background"
builds it in a process of its own at the first compile, and calls run in Python until it
is ready; "wait" builds it before the first call that would record; "off" never uses it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import openmp_waits
from ..codegen import build
from ..codegen.lower import CppKernel
from ..files import cache_root

SOURCE = Path(__file__).with_name("native_plan.cpp")
MODULE_NAME = "opweave_native"
NATIVE_FORMAT = 1
RECORD_AT_CALL = 2  # the first call may still measure (GEMM forms) or allocate lazily
MODES = ("background", "wait", "off")
# where the calling thread's OpenMP workers run: "apart" keeps them off the caller's CPU
# from a plan's call on (native_plan.cpp's WorkersApart says why), "system" leaves them
# where they are
WORKER_MODES = ("apart", "system")


def check_workers(mode: str) -> str:
    if mode not in WORKER_MODES:
        raise ValueError(f"workers must be one of {', '.join(WORKER_MODES)}; got {mode!r}")
    return mode


class NativeWarning(UserWarning):
    """The native runtime could not be built or disagreed with the Python steps; calls
    run the Python steps (same results, more overhead per operator)."""


class NotReplayable(Exception):
    """A recorded call did something a fixed replay cannot reproduce."""


# -- the module ----------------------------------------------------------------------------

_module = None
_problem: str | None = None
_spawned = False
_lock = threading.Lock()
_recording = threading.Lock()  # one recording at a time: CppKernel.recording is global
# this process was forked from one that had imported this module: a module loaded only
# now is told (native_plan.cpp's WorkersApart; one loaded before the fork saw it itself)
_forked = False


def _note_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_note_fork_in_child)


def _torch_dirs() -> tuple[list[Path], Path]:
    """torch's C++ include directories and its library directory, as in its wheel
    (what torch.utils.cpp_extension computes; importing that would import setuptools,
    which puts its vendored packages on sys.path)."""
    root = Path(torch.__file__).parent
    return [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"], \
        root / "lib"


def _flags() -> list[str]:
    includes = [*_torch_dirs()[0], sysconfig.get_paths()["include"]]
    abi = int(torch.compiled_with_cxx11_abi())
    return ["-O2", "-std=c++20", "-fPIC", "-shared", f"-DTORCH_EXTENSION_NAME={MODULE_NAME}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes)]


def _libraries() -> list[str]:
    lib = _torch_dirs()[1]
    return [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]


def _locate() -> tuple[Path, str, list[str], str]:
    """(the module's path in the cache, its key, the compiler flags that build it, the
    source). The key covers the source, compiler, flags, torch and Python, so nothing
    built for another of them is ever loaded; the source is read once, so the key always
    names the text that is compiled."""
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.exists():
        raise build.BuildError(f"Python's C headers are not installed ({python_h} is missing)")
    flags, source = _flags(), SOURCE.read_text()
    parts = [source, build.compiler_version(), " ".join(flags), torch.__version__,
             sys.version, str(NATIVE_FORMAT)]
    key = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
    flags.append(f'-DOPWEAVE_NATIVE_KEY="{key}"')
    path = cache_root() / f"native-v{NATIVE_FORMAT}" / f"{MODULE_NAME}-{key}.so"
    return path, key, flags, source


def _build_and_import(path: Path, key: str, flags: list[str], source: str):
    """The module at `path`: built from `source` unless an intact one is there (its
    content hash is checked before it is loaded), then asked for the key it was built with."""
    build.trusted_object(source, path, flags, _libraries())
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    if native.key() != key:
        build.move_aside(path, "identifies itself with another key")
        raise build.BuildError(f"{path} is not the native runtime it should be")
    _failure_note(path).unlink(missing_ok=True)
    return native


def _failure_note(path: Path) -> Path:
    return path.with_suffix(".failed")


def _lowest_priority() -> bool:
    """This process and its compiler at the lowest priority, as far as the system lets it
    (whether its scheduling group's priority went down too): the compile that started the
    builder goes on measuring forms on every core. Its session is its own, and so is its
    scheduling group where the kernel groups by session (autogroup), which shares the CPU
    between groups before nice counts: the group's own nice has to go down too. On the
    2-core Zen 4, a compiler in a group of equal weight made every oneDNN call 8 ms, not
    1 (an OpenMP barrier waiting out time slices), and the tuning database kept those
    times. Best effort: a system that refuses either still gets its module built."""
    try:
        os.nice(19 - os.nice(0))
    except (OSError, AttributeError):
        pass
    group = Path("/proc/self/autogroup")
    for _ in range(5):
        try:
            group.write_text("19\n")
            return True
        except BlockingIOError:  # one write per 100 ms per machine without CAP_SYS_ADMIN
            time.sleep(0.1)
        except OSError:
            return False  # no autogroups here: nice alone orders the processes
    return False


def _spawn_builder() -> None:
    """Build the module in a process of its own, which outlives this one: a short-lived
    program still leaves the module built for the next. Once per process."""
    global _spawned
    if _spawned:
        return
    _spawned = True
    subprocess.Popen([sys.executable, "-m", __name__], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def _load(wait: bool):
    path, key, flags, source = _locate()
    if not wait and not build.installed(path):
        note = _failure_note(path)
        if note.exists():
            raise build.BuildError(note.read_text().strip())
        _spawn_builder()
        return None
    return _build_and_import(path, key, flags, source)


def module(wait: bool):
    """The native module; None while it is being built (`wait=False`: by a process of its
    own, so no call waits) or when it cannot be (the reason is in `unavailable()`, and one
    NativeWarning said it). `wait=True` builds it here if need be."""
    global _module, _problem
    with _lock:
        if _module is None and _problem is None:
            try:
                _module = _load(wait)
                if _module is not None and _forked:
                    _module.note_forked()  # loaded after a fork: its own watch came too late
            except (build.BuildError, OSError, ImportError) as err:
                _problem = str(err)
                warnings.warn(f"opweave: the native runtime is unavailable, so compiled graphs "
                              f"run their steps from Python (same results, more overhead per "
                              f"operator): {err}", NativeWarning, stacklevel=2)
        return _module


def unavailable() -> str | None:
    return _problem


def loaded():
    """The native module if this process has loaded it already, else None (never builds
    or loads it: for callers that only profit from it, such as `TensorStamp`)."""
    return _module


# -- recording -----------------------------------------------------------------------------

class Recorder(TorchDispatchMode):
    """Records the operators and kernels one call runs, as they run, over numbered slots:
    the inputs first, then every tensor an operator returns. A tensor no recorded operator
    made (a weight, a packed weight, a preallocated buffer) is a constant of the plan.

    The record is kept in Python with slots in place of the call's tensors, so nothing
    recorded outlives its life in the call; the C++ plan is built from it after the call
    (`finish`). Built during the call, each instruction's small, long-lived allocations
    landed in the blocks the call's tensors had just freed and split them, and glibc's heap
    grew by what the next tensors could no longer fit into: the recording call of
    BERT-base's training step at batch 4 took the process from 2.5 to 4.9 GB, kept after."""

    def __init__(self, inputs: Sequence[torch.Tensor]):
        super().__init__()
        self.plan = _module.Plan(list(inputs))
        self.slot: dict[int, int] = {}  # id(tensor) -> slot, while the tensor lives
        self._refs: list[weakref.ref] = []
        self.slots = 0
        self.touched: list[list[int]] = []  # the slots each instruction reads or writes
        self.records: list[tuple] = []  # (name, overload, args, kwargs, outputs) or (address, slots)
        self.constants: dict[int, torch.Tensor] = {}
        self.kernels = 0
        self.failure: str | None = None
        self.thread = threading.get_ident()
        self.step_starts: list[int] = []  # the first instruction of each executor step
        self.views: dict[int, tuple[int, int]] = {}  # view slot -> (source slot, offset)
        for t in inputs:
            self._new(t)

    def begin_step(self, index: int) -> None:
        """The executor starts step `index` (steps are marked in order; a last mark after
        them begins what follows the steps: copies of outputs)."""
        assert index == len(self.step_starts), "steps are marked in order"
        self.step_starts.append(len(self.records))

    def _new(self, t: torch.Tensor) -> int:
        slot, key = self.slots, id(t)
        self.slots += 1
        self.slot[key] = slot
        # once it dies its id may be reused: forget it then (held here, not globally)
        self._refs.append(weakref.ref(t, lambda _, key=key, slot=slot: self._forget(key, slot)))
        return slot

    def _forget(self, key: int, slot: int) -> None:
        if self.slot.get(key) == slot:
            del self.slot[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        try:
            self._op(func, args, kwargs, result)
        except NotReplayable as err:
            self.failure = self.failure or str(err)  # kept even if a step swallows it
            raise
        return result

    def _op(self, func, args, kwargs, result) -> None:
        if func is torch.ops.aten._local_scalar_dense.default:
            raise NotReplayable(f"a step reads a tensor's value into Python ({func})")
        if self._restride(func, args, result) or self._fresh(func, result):
            return
        used: set[int] = set()
        args, kwargs = _slotted((args, kwargs), self.slot, used)
        outputs = [-1 if r is None else self.slot[id(r)] if id(r) in self.slot else self._new(r)
                   for r in _returned_tensors(func, result)]
        schema = func._schema
        self.records.append((schema.name, schema.overload_name, args, kwargs, outputs))
        self.touched.append([*used, *outputs])

    def _restride(self, func, args, result) -> bool:
        """Record a view of a plan's value as the sizes, strides and offset it gave (one
        restride in C++, where a boxed call costs 2-5 us: BERT-base's 186 views, ResNet-50's
        36); a view of a view, as one of the first's source. False where it is not one: a
        view that changes the type or the conjugate or negative bits, or of a constant."""
        if not (func.is_view and func not in _type_changing_views() and isinstance(result, torch.Tensor)
                and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.slot):
            return False
        source = args[0]
        if (result.dtype != source.dtype or result.device != source.device
                or result.is_conj() != source.is_conj() or result.is_neg() != source.is_neg()
                or result.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()):
            return False
        slot = self.slot[id(source)]
        root, offset = self.views.get(slot, (slot, 0))
        offset += result.storage_offset() - source.storage_offset()
        out = self._new(result)
        self.views[out] = (root, offset)
        self.records.append(("view", root, tuple(result.shape), tuple(result.stride()), offset,
                             out))
        self.touched.append([root, out])
        return True

    def _fresh(self, func, result) -> bool:
        """Record an empty tensor's allocation as its sizes, strides and type (a direct
        call in C++, not a boxed one)."""
        if func not in _allocations() or not isinstance(result, torch.Tensor) \
                or result.device.type != "cpu" or result.requires_grad \
                or result.layout != torch.strided:
            return False
        out = self._new(result)
        self.records.append(("empty", tuple(result.shape), tuple(result.stride()),
                             torch.empty(0, dtype=result.dtype), out))
        self.touched.append([out])
        return True

    def kernel(self, address: int, tensors: Sequence[torch.Tensor]) -> None:
        """A raw call `void f(void**)` (generated kernels, quantizers and direct oneDNN
        primitives report theirs through `CppKernel.recording`): pointer arguments in
        order."""
        if threading.get_ident() != self.thread:
            return
        slots = []
        for t in tensors:
            if id(t) not in self.slot:
                self.constants[self._new(t)] = t
            slots.append(self.slot[id(t)])
        self.records.append((address, slots))
        self.touched.append(slots)
        self.kernels += 1

    def _drop_unread_views(self, output_slots) -> None:
        """A view only another view read (now made from its source directly) makes nothing:
        its record stays, as a no-op touching no slot, so instruction numbers keep."""
        read = set(output_slots)
        for i in range(len(self.records) - 1, -1, -1):
            record = self.records[i]
            if record[0] == "view" and record[-1] not in read:
                self.records[i] = (*record[:-1], -1)
                self.touched[i] = []
                continue
            read.update(self.touched[i])

    def finish(self, outputs: Sequence[torch.Tensor]):
        """The plan, returning `outputs`, with every slot dropped after its last use."""
        if self.failure is not None:
            raise NotReplayable(self.failure)
        output_slots = []
        for t in outputs:
            if id(t) not in self.slot:
                raise NotReplayable("an output was not made by a recorded operator")
            output_slots.append(self.slot[id(t)])
        plan = self.plan
        self._drop_unread_views(output_slots)
        stand_ins: dict[int, torch.Tensor] = {}  # slot -> the tensor add_op finds it by
        for record in self.records:
            if len(record) == 2:
                plan.add_kernel(*record)
                continue
            if record[0] == "view":
                plan.add_view(*record[1:])
                continue
            if record[0] == "empty":
                plan.add_empty(*record[1:])
                continue
            name, overload, args, kwargs, returned = record
            used: dict[int, torch.Tensor] = {}
            args, kwargs = _filled((args, kwargs), stand_ins, used)
            try:
                plan.add_op(name, overload, tuple(args), dict(kwargs), used, returned)
            except RuntimeError as err:
                raise NotReplayable(f"{name}.{overload} cannot be called from C++: {err}") \
                    from None
        self.records = []
        plan.set_slots(self.slots)
        for slot, tensor in self.constants.items():
            plan.add_constant(slot, tensor)
        plan.set_outputs(output_slots)
        last = {s: i for i, slots in enumerate(self.touched) for s in slots if s >= 0}
        keep = set(output_slots) | set(self.constants)
        frees: dict[int, list[int]] = {}
        for s, i in last.items():
            if s not in keep:
                frees.setdefault(i, []).append(s)
        for i, slots in frees.items():
            plan.set_frees(i, slots)
        self.layout = PlanLayout(self.step_starts, len(self.touched),
                                 [list(t) for t in self.touched], keep)
        return plan


@dataclass(frozen=True)
class PlanLayout:
    """Which instructions of a recorded plan each executor step ran, and the slots each
    instruction touched: what schedule/concurrent.py needs to run steps in stages.
    `step_starts[k]` is step k's first instruction; the last entry begins what follows
    the steps (instructions before the first entry precede them)."""
    step_starts: list[int]
    instructions: int
    touched: list[list[int]]
    keep: set[int]          # slots never dropped: outputs and constants

    def step_range(self, k: int) -> range:
        return range(self.step_starts[k], self.step_starts[k + 1])


@lru_cache(maxsize=1)
def _type_changing_views() -> frozenset:
    """Views that give another dtype or reinterpret the elements (or, like detach, mean
    more than their sizes and strides): recorded as boxed calls."""
    aten = torch.ops.aten
    return frozenset({aten.view.dtype, aten.view_as_real.default, aten.view_as_complex.default,
                      aten.real.default, aten.imag.default, aten._conj.default,
                      aten._neg_view.default, aten.detach.default, aten.alias.default})


@lru_cache(maxsize=1)
def _allocations() -> frozenset:
    """Allocations replayed as a direct empty_strided."""
    return frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default})


class _Slot(int):
    """A recorded argument that was the tensor in this slot."""


def _map_arguments(item, leaf):
    """`item` (nested lists, tuples and dicts of an operator's arguments) with `leaf`
    applied to everything else in it."""
    if type(item) in (list, tuple):
        return type(item)(_map_arguments(x, leaf) for x in item)
    if type(item) is dict:
        return {k: _map_arguments(x, leaf) for k, x in item.items()}
    return leaf(item)


def _slotted(item, slot_of: dict[int, int], used: set[int]):
    """`item` with its slot tensors replaced by `_Slot`s; their slots are added to `used`."""
    def leaf(x):
        if isinstance(x, torch.Tensor) and id(x) in slot_of:
            used.add(slot_of[id(x)])
            return _Slot(slot_of[id(x)])
        return x
    return _map_arguments(item, leaf)


def _filled(item, stand_ins: dict[int, torch.Tensor], used: dict[int, torch.Tensor]):
    """`item` with each `_Slot` replaced by its slot's stand-in, an empty tensor the plan
    recognises by identity (`Plan.add_op` keeps none of them)."""
    def leaf(x):
        if not isinstance(x, _Slot):
            return x
        slot = int(x)
        if slot not in stand_ins:
            stand_ins[slot] = torch.empty(0)
        used[slot] = stand_ins[slot]
        return stand_ins[slot]
    return _map_arguments(item, leaf)


def _returned_tensors(func, result) -> list:
    """The tensors an operator returned, flattened as the C++ side flattens its stack."""
    items = result if isinstance(result, (tuple, list)) and not _returns_one_list(func) \
        else [result]
    flat = []
    for item in items:
        if item is None or isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in item):
            flat.extend(item)
        else:
            raise NotReplayable(f"{func} returns a {type(item).__name__} that Python may "
                                f"decide on")
    return flat


def _returns_one_list(func) -> bool:
    returns = func._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


# -- one executor's state ------------------------------------------------------------------

class NativeState:
    """Where one executor stands: counting calls, recorded (to be checked), active (`plan`
    set) or off (`reason` set)."""

    def __init__(self, mode: str, graph_name: str, workers: str = "apart"):
        if mode not in MODES:
            raise ValueError(f"native mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.workers = check_workers(workers)
        self.graph_name = graph_name
        self.plan = None
        self.reason: str | None = "disabled (native='off')" if mode == "off" else None
        self._candidate = None
        self.layout: PlanLayout | None = None  # the candidate's, then the plan's
        self._calls = 0
        self.counts = (0, 0)  # (operators, kernels) of the recorded call
        self._lock = threading.Lock()  # one thread at a time counts, records or checks
        if mode == "background":
            module(wait=False)

    @property
    def pending(self) -> bool:
        return self.plan is None and self.reason is None

    @contextmanager
    def suspended(self, why: str):
        """Calls run the Python steps meanwhile (the profiler times them one by one); the
        plan, or the progress towards one, is back afterwards."""
        with self._lock:
            saved = self.plan, self.reason
            self.plan, self.reason = None, why
        try:
            yield
        finally:
            with self._lock:
                self.plan, self.reason = saved

    def describe(self) -> str:
        if self.plan is not None:
            ops, kernels = self.counts
            # raw calls: generated kernels, quantizers, direct oneDNN primitives
            threads = ("; OpenMP workers kept off the caller's CPU"
                       if self.plan.workers_kept_apart else "") \
                + ("; a second calling thread's OpenMP waits spin (set at import)"
                   if openmp_waits.applied() else "")
            return f"native plan ({ops} operator calls, {kernels} raw kernel calls{threads})"
        if self.reason is not None:
            return f"Python steps: {self.reason}"
        return "Python steps (the native plan is recorded at a later call)"

    def call(self, run, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One call through the Python steps `run`, recording or checking on the way
        (a call that meets another thread doing so just runs the Python steps)."""
        if not self._lock.acquire(blocking=False):
            return run(inputs)
        try:
            return self._step(run, inputs)
        finally:
            self._lock.release()

    def _step(self, run, inputs):
        if not self.pending:
            return run(inputs)
        self._calls += 1
        if self._calls < RECORD_AT_CALL or not _replayable_now(inputs):
            return run(inputs)
        if module(wait=self.mode == "wait") is None:
            if unavailable() is not None:
                self.reason = f"the native runtime is unavailable ({unavailable()})"
            return run(inputs)
        if self._candidate is None:
            return self._record(run, inputs)
        return self._check(run, inputs)

    def _record(self, run, inputs):
        if not _recording.acquire(blocking=False):  # another thread records: later
            return run(inputs)
        recorder = Recorder(inputs)
        CppKernel.recording = recorder.kernel
        try:
            with recorder:
                outputs = run(inputs, mark=recorder.begin_step)
        except NotReplayable as err:
            self.reason = str(err)
            return run(inputs)
        finally:
            CppKernel.recording = None
            _recording.release()
        try:
            self._candidate = recorder.finish(outputs)
            self._candidate.set_workers_apart(self.workers == "apart")
            self.layout = recorder.layout
        except NotReplayable as err:
            self.reason = str(err)
        self.counts = (len(recorder.touched) - recorder.kernels, recorder.kernels)
        return outputs

    def _check(self, run, inputs):
        # both runs draw the same random numbers (dropout, rand_like in training graphs)
        rng = torch.random.get_rng_state()
        expected = run(inputs)
        after = torch.random.get_rng_state()
        torch.random.set_rng_state(rng)
        try:
            got = self._candidate.run(list(inputs))
        except RuntimeError as err:
            torch.random.set_rng_state(after)
            self._refuse(f"its replay failed: {err}")
            return expected
        if got is None:  # other strides than recorded: record again on a later call
            torch.random.set_rng_state(after)
            self._candidate = None
            return expected
        mismatch = _first_mismatch(expected, got)
        if mismatch is not None:
            self._refuse(f"its replay disagrees with the Python steps ({mismatch})")
        else:
            self.plan = self._candidate
        self._candidate = None
        return expected

    def _refuse(self, reason: str) -> None:
        self.reason = reason
        self._candidate = None
        warnings.warn(f"opweave: graph @{self.graph_name} runs its steps from Python: the "
                      f"native plan {reason}", NativeWarning, stacklevel=4)


def _replayable_now(inputs) -> bool:
    """Whether a call may be recorded: under autograd the Python steps would be recorded
    below it, so a call with inputs that require grad is left to Python."""
    return not (torch.is_grad_enabled()
                and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))


def _first_mismatch(expected, got) -> str | None:
    if len(expected) != len(got):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return f"output {i} is {tuple(b.shape)} {b.dtype} {b.stride()}, expected " \
                   f"{tuple(a.shape)} {a.dtype} {a.stride()}"
        if not torch.equal(a, b) and not (a.is_floating_point() and torch.allclose(
                a, b, rtol=1e-6, atol=1e-6, equal_nan=True)):
            return f"output {i} differs"
    return None


if __name__ == "__main__":  # the builder `_spawn_builder` starts
    _lowest_priority()
    _located = _locate()
    try:
        _build_and_import(*_located)
    except (build.BuildError, OSError, ImportError) as _err:
        from ..files import atomic_write

        atomic_write(_failure_note(_located[0]), lambda tmp: tmp.write_text(f"{_err}\n"))
