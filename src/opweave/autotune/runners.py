"""Where tuning trials run. Both runners start the same worker process per request
(`search.run_worker`), so a crashing candidate still kills only its worker:

- `LocalRunner`: here, one request at a time (parallel trials on one machine would time
  each other's interference);
- `RayRunner`: as Ray tasks (`opweave tune MODEL --ray [ADDRESS]`), several at a time, on
  the cluster at ADDRESS or on a local one it starts (and stops). Each task reports the
  target it measured on, so its records are keyed by that machine (tune/target.py).

`submit(request, timeout)` returns a `concurrent.futures.Future` of `Measured`.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass


@dataclass
class Measured:
    trials: list        # search.Trial per configuration of the request; empty on failure
    error: str          # why the worker measured nothing (it died, timed out, ...)
    descriptor: dict    # the target it ran on (tune.target.describe)
    where: str          # the host, for progress lines


def measure(request: dict, timeout: float) -> Measured:
    """One request in a worker process, on this machine (also the body of a Ray task)."""
    import platform

    from .search import WorkerFailed, run_worker
    from ..tune.target import describe

    descriptor = describe(request["threads"])
    try:
        return Measured(run_worker(request, timeout), "", descriptor, platform.node())
    except WorkerFailed as err:
        return Measured([], str(err), descriptor, platform.node())


class LocalRunner:
    slots = 1

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opweave-tune")

    def submit(self, request: dict, timeout: float) -> Future:
        return self._pool.submit(measure, request, timeout)

    def describe(self) -> str:
        return "locally, one worker process at a time"

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class RayRunner:
    def __init__(self, address: str | None, workers: int | None, threads: int):
        try:
            import ray
        except ImportError as err:
            raise RuntimeError("--ray needs Ray: pip install 'opweave[ray]' "
                               f"(the lock pins its version) ({err})") from None
        self._ray = ray
        self._started = not ray.is_initialized()
        if self._started:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:  # a local cluster sized so `workers` tasks of `threads` CPUs fit at once
                workers = workers or max(1, (os.cpu_count() or 1) // threads)
                ray.init(num_cpus=workers * threads, include_dashboard=False,
                         log_to_driver=False)
        nodes = [n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        if max(nodes, default=0) < threads:
            self.close()
            raise RuntimeError(f"no node of the Ray cluster has {threads} CPUs for a trial of "
                               f"{threads} thread(s) (nodes: {nodes}); pass fewer --threads")
        slots = int(sum(n // threads for n in nodes))
        self.slots = max(1, min(workers or slots, slots))
        self._task = ray.remote(num_cpus=threads, max_retries=0)(measure)
        self._where = f"on Ray ({address or 'a local cluster'}), {self.slots} worker(s)"

    def submit(self, request: dict, timeout: float) -> Future:
        return self._task.remote(request, timeout).future()

    def describe(self) -> str:
        return self._where

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()
