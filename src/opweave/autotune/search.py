"""`opweave tune MODEL`: search one model's whole-graph configurations (tune/configs.py)
with Optuna's TPE sampler, measuring each candidate end to end in a worker process of its
own (autotune/worker.py: a candidate that crashes or hangs the compiler fails alone).

Every measured trial is kept in the database ("model-trial" records, keyed by the model,
the configuration and the target, with the graph keys the compile saw), so an interrupted
or repeated run resumes: trials of the same graphs are read back instead of measured. The
untuned configuration is always measured first (it is the baseline, and its compile says
which graphs the model has). The search ends at the trial or time budget, or when every
configuration is measured. The best few are then timed again, interleaved in one worker
with the baseline, since trials measured in separate processes drift with the machine's
load; the fastest of that run becomes each graph's "graph-config" record, which
`opweave.compile` and the Dynamo backend use from then on.

The workers compile with `kernels="tune"`: a generated kernel's schedules are measured the
first time a trial builds it and recorded ("kernel-schedule"), so every trial, the
confirmation and later compiles run the same tuned kernels. They also compile with
`recheck`: every library form the model meets is measured again and decided on all its
samples, so a record taken under load is corrected.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..tune import configs
from ..tune.db import Record, TuningDB
from ..tune.target import describe, target_id

TRIAL_KIND = "model-trial"
MAX_REPEATS = 20  # proposals in a row of measured configurations before one is enqueued
WORKER = [sys.executable, "-m", "opweave.autotune.worker"]  # + REQUEST.json RESULT.json


class WorkerFailed(RuntimeError):
    """A tuning worker died, hung past its timeout, or could not measure anything."""


@dataclass
class Trial:
    config: dict
    samples: list[float] = field(default_factory=list)
    error: str = ""
    graph_keys: list[tuple[str, str]] = field(default_factory=list)
    resumed: bool = False  # read back from the database, not measured in this run
    # no worker answered (it died, timed out, its Ray task was lost): possibly the
    # machine's doing, so a later run measures it again; a failure the worker reported
    # (the compile raised, the outputs differ) is remembered
    transient: bool = False

    @property
    def seconds(self) -> float:
        return statistics.median(self.samples) if self.samples and not self.error else math.inf


@dataclass
class TuneResult:
    model: str
    best: Trial
    baseline: Trial
    trials: list[Trial]
    confirmed: list[Trial]
    seconds: float  # wall time of the whole search

    def summary(self) -> str:
        measured = sum(not t.resumed for t in self.trials)
        speedup = self.baseline.seconds / self.best.seconds
        return (f"{self.model}: {configs.describe_config(self.best.config)} at "
                f"{self.best.seconds * 1e3:.3f} ms, {speedup:.2f}x the untuned "
                f"{configs.describe_config(self.baseline.config)} ({self.baseline.seconds * 1e3:.3f} ms); "
                f"{len(self.trials)} trial(s), {measured} measured in this run, "
                f"{self.seconds:.0f} s")


def run_worker(request: dict, timeout: float) -> list[Trial]:
    """One worker process over `request["configs"]`; a Trial per configuration."""
    with tempfile.TemporaryDirectory(prefix="opweave-tune-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        try:
            proc = subprocess.run([*WORKER, str(request_path), str(result_path)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WorkerFailed(f"the worker ran past its {timeout:.0f} s timeout") from None
        if proc.returncode != 0 or not result_path.exists():
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise WorkerFailed(f"the worker exited with status {proc.returncode}"
                               + (": " + " | ".join(tail) if tail else ""))
        result = json.loads(result_path.read_text())
    if "error" in result:
        raise WorkerFailed(result["error"].strip().splitlines()[-1])
    return [Trial(r["config"], r.get("samples", []), r.get("error", ""),
                  [tuple(k) for k in r.get("graph_keys", [])]) for r in result["results"]]


def _trial_workload(model: str, small: bool, config: dict) -> tuple[str, str]:
    """`model` names the model and the path: "resnet50" or "resnet50 via torch.compile"."""
    text = f"{model}{' (small)' if small else ''}: {configs.describe_config(config)}"
    return hashlib.sha256(text.encode()).hexdigest()[:32], text


def _save_trial(db: TuningDB, model: str, small: bool, trial: Trial, descriptor: dict) -> None:
    digest, text = _trial_workload(model, small, trial.config)
    seconds = trial.seconds if math.isfinite(trial.seconds) else 1e9  # failed: never best
    db.put(Record(TRIAL_KIND, digest, target_id(descriptor), text,
                  {"config": trial.config, "graph_keys": trial.graph_keys, "error": trial.error,
                   "transient": trial.transient},
                  seconds, {"calls": trial.samples}), descriptor)


def _load_trial(db: TuningDB, model: str, small: bool, config: dict, keys, target: str):
    """The recorded trial of `config`, if it was measured on the same graphs on `target`
    (a transient failure is not: it is measured again)."""
    record = db.get(TRIAL_KIND, _trial_workload(model, small, config)[0], target)
    if record is None or record.config.get("transient") \
            or [tuple(k) for k in record.config.get("graph_keys", [])] != keys:
        return None
    return Trial(config, record.samples.get("calls", []), record.config.get("error", ""), keys,
                 resumed=True)


def tune_model(model: str, db: TuningDB, *, small: bool = False, trials: int | None = None,
               budget: float | None = None, threads: int | None = None, rounds: int = 10,
               confirm: int = 3, seed: int = 0, timeout: float = 1800.0, runner=None,
               dynamo: bool = False,
               progress: Callable[[str], None] | None = None) -> TuneResult:
    """Search `model`'s configurations; record the best for each of its graphs in `db`.
    `dynamo`: tune the graphs `torch.compile(backend="opweave")` makes (under no_grad)
    instead of those of `opweave.compile`.
    `trials`: at most this many measured trials (default: the whole space); `budget`:
    seconds after which no new trial starts; `runner`: where trials run (default: a
    `runners.LocalRunner`, closed at the end; a runner passed in is left open)."""
    import torch

    from .runners import LocalRunner

    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    threads = threads or torch.get_num_threads()
    own = runner is None
    runner = runner or LocalRunner()
    request = {"model": model, "small": small, "threads": threads, "rounds": rounds,
               "path": "dynamo" if dynamo else "export", "tuning_db": str(db.path),
               "kernels": "tune", "recheck": True}
    name = f"{model} via torch.compile" if dynamo else model
    search = _Search(name, db, small, request, runner, timeout, progress or (lambda line: None))
    try:
        return search.run(trials, budget, confirm, seed)
    finally:
        if own:
            runner.close()


class _Search:
    """One run of `tune_model`: the trials measured or read back, keyed by name."""

    def __init__(self, model, db, small, request, runner, timeout, say):
        self.model, self.db, self.small, self.request = model, db, small, request
        self.runner, self.timeout, self.say = runner, timeout, say
        self.start = time.perf_counter()
        self.done: dict[str, Trial] = {}
        self.target: str | None = None  # where the baseline ran: earlier trials are read there

    def submit(self, configs_: list[dict], rounds: int | None = None):
        request = {**self.request, "configs": configs_}
        if rounds is not None:
            request["rounds"] = rounds
        return self.runner.submit(request, self.timeout)

    def collect(self, future, config: dict, keys=()) -> Trial:
        """The trial a finished single-configuration request measured, saved under the
        target it ran on (a crash is remembered too, for the graphs it was on)."""
        measured = _result(future, self.request["threads"])
        if measured.trials:
            trial = measured.trials[0]
            if trial.error and not trial.graph_keys:  # its compile raised before any graph
                trial.graph_keys = list(keys)
        else:
            trial = Trial(config, error=measured.error, graph_keys=list(keys), transient=True)
        _save_trial(self.db, self.model, self.small, trial, measured.descriptor)
        if not self.done:  # the baseline: its target is where earlier trials are looked up
            self.target = target_id(measured.descriptor)
        return trial

    def run(self, trials, budget, confirm, seed) -> TuneResult:
        import optuna

        self.say(f"measuring {self.runner.describe()}")
        baseline = self.collect(self.submit([dict(configs.DEFAULT)]), configs.DEFAULT)
        if baseline.error:
            raise WorkerFailed(f"{self.model} does not compile with the untuned "
                               f"configuration: {baseline.error}")
        keys = baseline.graph_keys
        if not keys:
            raise WorkerFailed(f"{self.model} has no graph opweave compiles (it runs in "
                               "eager); there is nothing to tune")
        self.say(f"trial 1: {configs.describe_config(baseline.config)}: "
                 f"{baseline.seconds * 1e3:.3f} ms")
        self.done[configs.describe_config(baseline.config)] = baseline
        self._resume(keys)

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = {k: optuna.distributions.CategoricalDistribution(v)
                 for k, v in configs.SPACE.items()}
        study = optuna.create_study(direction="minimize",
                                    sampler=optuna.samplers.TPESampler(seed=seed))
        for trial in self.done.values():
            study.add_trial(_frozen(trial, space))
        limit = trials if trials is not None else len(configs.all_configs())
        measured, pending = 1, {}  # future -> (asked trial, name)
        while True:
            while (len(pending) < self.runner.slots and measured + len(pending) < limit
                   and (budget is None or time.perf_counter() - self.start < budget)):
                asked = self._ask(study, space, {name for _, name in pending.values()})
                if asked is None:
                    break
                name = configs.describe_config(asked.params)
                pending[self.submit([dict(asked.params)])] = (asked, name)
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                asked, name = pending.pop(future)
                trial = self.done[name] = self.collect(future, dict(asked.params), keys)
                measured += 1
                _tell(study, asked, trial)
                best = min(self.done.values(), key=lambda t: t.seconds)
                self.say(f"trial {measured}: {name}: "
                         + (f"failed ({trial.error})" if trial.error
                            else f"{trial.seconds * 1e3:.3f} ms")
                         + f"; best {configs.describe_config(best.config)} "
                         f"{best.seconds * 1e3:.3f} ms")
        return self._confirm(keys, baseline, confirm)

    def _resume(self, keys) -> None:
        """Read back the trials measured before on the target the baseline ran on."""
        for config in configs.all_configs():
            name = configs.describe_config(config)
            trial = _load_trial(self.db, self.model, self.small, config, keys, self.target)
            if trial is not None and name not in self.done:
                self.done[name] = trial
                self.say(f"resumed: {name}: " + (trial.error or f"{trial.seconds * 1e3:.3f} ms"))

    def _ask(self, study, space, running: set[str]):
        """A trial of a configuration neither measured nor running; None when none is
        left. TPE may propose a measured one again: it is answered from memory (a running
        one is pruned), and after MAX_REPEATS such proposals the next one is enqueued."""
        import optuna

        left = [c for c in configs.all_configs()
                if configs.describe_config(c) not in self.done
                and configs.describe_config(c) not in running]
        if not left:
            return None
        for _ in range(MAX_REPEATS):
            asked = study.ask(space)
            name = configs.describe_config(asked.params)
            if name in self.done:
                _tell(study, asked, self.done[name])
            elif name in running:
                study.tell(asked, state=optuna.trial.TrialState.PRUNED)
            else:
                return asked
        study.enqueue_trial(left[0])
        return study.ask(space)

    def _confirm(self, keys, baseline: Trial, confirm: int) -> TuneResult:
        ranked = sorted((t for t in self.done.values() if not t.error), key=lambda t: t.seconds)
        finalists = [t.config for t in ranked[:confirm]]
        if configs.DEFAULT not in finalists:
            finalists.append(dict(configs.DEFAULT))
        self.say(f"confirming {len(finalists)} configuration(s), interleaved")
        measured = _result(self.submit(finalists, rounds=2 * self.request["rounds"]),
                           self.request["threads"])
        usable = [t for t in measured.trials if not t.error and t.graph_keys == keys]
        if not usable:
            raise WorkerFailed(f"the confirmation run of {self.model} measured nothing usable: "
                               + (measured.error or "; ".join(t.error for t in measured.trials)))
        best = min(usable, key=lambda t: t.seconds)
        configs.remember(keys, best.config, best.seconds,
                         {configs.describe_config(t.config): t.samples for t in usable},
                         self.db, measured.descriptor)
        base = next((t for t in usable if t.config == configs.DEFAULT), baseline)
        return TuneResult(self.model, best, base, list(self.done.values()), measured.trials,
                          time.perf_counter() - self.start)


def _result(future, threads: int):
    """A runner's `Measured`; a task that failed outside the worker (a Ray node lost) is
    a measurement of nothing, with the reason."""
    from .runners import Measured

    try:
        return future.result()
    except Exception as err:  # noqa: BLE001
        return Measured([], f"{type(err).__name__}: {err}", describe(threads), "?")


def _frozen(trial: Trial, space):
    import optuna

    if trial.error:
        return optuna.trial.create_trial(params=trial.config, distributions=space,
                                         state=optuna.trial.TrialState.FAIL)
    return optuna.trial.create_trial(params=trial.config, distributions=space,
                                     value=trial.seconds)


def _tell(study, asked, trial: Trial) -> None:
    import optuna

    if trial.error:
        study.tell(asked, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(asked, trial.seconds)
