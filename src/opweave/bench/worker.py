"""Worker processes: one per backend and model, so that backends never share a process.

Thread pools of different runtimes fight when they live in one process (ONNX Runtime's
spinning workers slowed eager ResNet-50 from 100 to 186 ms here). Each backend therefore
runs in its own process; the parent alternates them by sending one "run" at a time, and
each worker times its own calls, so the pipe's latency is never in a sample.

This module must not import torch at the top: the thread settings below have to be in the
environment before torch (or ONNX Runtime, or TVM) starts its pools.
"""
from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

from .modes import INFER
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "TVM_NUM_THREADS")
CALLERS = ("main", "thread")  # WorkerSpec.caller


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: the model, the mode, and the threads it may use."""

    model: str
    mode: str = INFER
    threads: int = 1
    batch: int = 1
    small: bool = False
    backend: str | None = None  # None: a helper worker (FLOPs, calibration), no backend
    log_path: str | None = None  # where the worker's stdout/stderr go (library chatter)
    caller: str = "main"  # "thread": timed calls come from one other thread (_Session.run)


class WorkerError(RuntimeError):
    """The worker crashed, timed out or raised; the message carries its traceback."""


class BackendUnavailable(RuntimeError):
    """The backend cannot run this model; the message is the reason."""


class Worker:
    """Parent-side handle of one worker process."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=serve, args=(child_conn, spec), daemon=True,
                                       name=f"opweave-bench-{spec.backend or 'helper'}")
        with _peer_environment(spec.backend):
            self.process.start()
        child_conn.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, command: str, *args, timeout: float | None = None):
        """Run `command` in the worker and return its result."""
        if self._conn.closed or not self.process.is_alive():
            raise WorkerError(f"worker is gone (exit code {self.process.exitcode}); "
                              f"cannot run {command}")
        try:
            self._conn.send((command, args))
            if not self._conn.poll(timeout):
                self.close()
                raise WorkerError(f"{command} timed out after {timeout:.0f} s")
            status, value = self._conn.recv()
        except (EOFError, OSError):  # broken pipe, reset, closed handle
            self.process.join(1)
            raise WorkerError(f"worker process died during {command} "
                              f"(exit code {self.process.exitcode})") from None
        if status == "unavailable":
            raise BackendUnavailable(value)
        if status == "error":
            raise WorkerError(value)
        return value

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextmanager
def _peer_environment(backend: str | None):
    """The environment a worker starts in. The child imports opweave (this module is
    opweave's) before torch, which would set libgomp's waits for it (openmp_waits.py); a
    peer's worker (eager, Inductor, ...) runs as its users' processes do, without them."""
    from .. import openmp_waits

    peer = backend is not None and not backend.startswith("opweave")
    saved = os.environ.get(openmp_waits.ENV)
    if peer:
        os.environ[openmp_waits.ENV] = "system"
    try:
        yield
    finally:
        if peer:
            if saved is None:
                del os.environ[openmp_waits.ENV]
            else:
                os.environ[openmp_waits.ENV] = saved


def wait_until_idle(timeout_s: float = 1.0) -> bool:
    """Wait until no other thread of this process is running or runnable.

    Thread pools spin for a while after work (ONNX Runtime's for about 20 ms, OpenMP's
    shorter). A spinning thread is in state R even while another process has its core,
    so this reads each thread's state (Linux /proc) rather than measuring CPU time, which
    a descheduled spinner would not show. False if threads still spin after `timeout_s`.
    """
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        busy = _runnable_threads()
        if busy is None:  # no /proc: fall back to a short grace period
            time.sleep(0.05)
            return True
        if not busy:
            return True
        time.sleep(0.001)
    return False


def _runnable_threads() -> int | None:
    """How many threads of this process, other than the calling one, are in state R."""
    import threading

    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # the thread just exited
            continue
        count += state == "R"
    return count


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them
    otherwise, and they would count in the resident set)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def limit_threads(threads: int) -> None:
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)


def serve(conn, spec: WorkerSpec) -> None:
    """The worker's loop: answer (command, args) requests until it receives None."""
    limit_threads(spec.threads)
    if spec.log_path:
        _redirect_output(spec.log_path)
    session = _Session(spec)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        command, args = request
        try:
            reply = ("ok", getattr(session, command)(*args))
        except BackendUnavailable as error:
            reply = ("unavailable", str(error))
        except Exception:
            reply = ("error", traceback.format_exc())
        conn.send(reply)


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (native libraries' too) to `path`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class _Session:
    """The worker-side state: the model and, once prepared, the backend's step."""

    def __init__(self, spec: WorkerSpec):
        import warnings

        import torch

        warnings.simplefilter("ignore")  # library chatter would only garble the progress bar
        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.prepared = None
        self._bench = None
        self._caller_thread = None  # made at the first call with caller="thread"

    @property
    def bench(self):
        if self._bench is None:
            from ..models import build

            self._bench = build(self.spec.model, small=self.spec.small).with_batch(self.spec.batch)
        return self._bench

    def notes(self) -> str:
        notes = self.bench.notes
        if self.spec.batch > 1 and not self.bench.batched:
            notes += "; whole-graph input, --batch does not apply"
        return notes

    def prepare(self) -> dict:
        from . import backends

        try:
            self.prepared = backends.prepare(self.spec.backend, self.bench, self.spec.mode,
                                             self.spec.threads)
        except backends.Unavailable as error:
            raise BackendUnavailable(str(error)) from None
        p = self.prepared
        if not p.torch_memory:
            # a runtime with its own copy of the weights: free torch's, so that its
            # peak RSS counts one copy, as the torch backends' does
            self._bench = None
        # what compiling freed (graphs, e-graphs, traces) is not memory a step needs:
        # hand it back, for every backend alike
        _release_freed_memory()
        return dict(setup_s=p.setup_s, outputs=p.first_outputs, note=p.note,
                    torch_memory=p.torch_memory)

    def run(self, count: int = 1, pause_s: float = 0.0) -> list[float]:
        """Seconds of each of `count` calls of the prepared step, each after sleeping
        `pause_s`, made by the main thread or, with `caller="thread"`, by one other thread
        that makes every call of this worker (a server's handler thread: the main thread,
        which prepared the model, keeps its OpenMP team; docs/runtime.md). Returns once
        this process has gone quiet, so that no thread of it still spins while the parent
        times the next backend."""
        step = self.prepared.step

        def calls():
            samples = []
            for _ in range(count):
                if pause_s > 0:
                    time.sleep(pause_s)
                start = time.perf_counter()
                step()
                samples.append(time.perf_counter() - start)
            return samples

        if self.spec.caller == "thread":
            samples = self._caller().submit(calls).result()
        else:
            samples = calls()
        wait_until_idle()
        return samples

    def _caller(self):
        """The one thread that makes this worker's calls with `caller="thread"`."""
        if self._caller_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._caller_thread = ThreadPoolExecutor(1, thread_name_prefix="opweave-caller")
        return self._caller_thread

    def memory(self) -> dict:
        """Peak resident memory of the process during one step, and, where torch allocates
        the working memory, the peak of torch's allocations during it (bytes)."""
        from .memory import peak_rss_during

        from ..tools.memory_stats import peak_allocated_bytes

        result = dict(peak_rss=peak_rss_during(self.prepared.step))
        if self.prepared.torch_memory:
            result["torch_peak"] = peak_allocated_bytes(self.prepared.step)
        return result

    def flops(self) -> float:
        from .roofline import model_flops

        return model_flops(self.bench, self.spec.mode)

    def gemm_peak(self) -> float:
        from ..cost.machine import measure_gemm_peak

        return measure_gemm_peak()
