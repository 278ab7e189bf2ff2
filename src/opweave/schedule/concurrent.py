"""Concurrent stages on the native plan: a compiled graph's steps scheduled into stages
(schedule/stages.py: IOS's dynamic program, or FastT's critical-path list scheduler) on
their costs measured in place, and run by the native plan (runtime/native_plan.cpp): the
groups of a concurrent stage at once, one thread of the caller's OpenMP team each.

Nothing is assumed. Once an executor's native plan is active, its next call:
1. measures every step on every thread and on one (`Plan.timed`: the plan run step by
   step on t threads), and the price of a fork and join;
2. schedules the steps on those costs;
3. runs the staged plan and checks its outputs against the plan run step by step;
4. measures each stage as it runs and splits back the concurrent stages that lost to
   their own steps run one after another;
5. times both, interleaved, and keeps the stages only if they are faster.
The decision and the measured costs are remembered in the tuning database (kind
"stage-schedule", keyed by the graph, its steps and the thread count): a later process on
this machine schedules from the recorded costs, checks the outputs again and measures
nothing. What was decided, and why, is `Staging.describe()` (shown by `explain`).
"""
from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .. import tune
from ..files import atomic_write
from ..notices import warn_once
from ..tune import Record, TuningDB
from ..tune.configs import graph_key
from ..tune.target import describe as describe_target
from ..tune.target import target_id
from . import stages as st

SCHEDULES = ("sequential", "critical-path", "ios")
KIND = "stage-schedule"
REPEATS = 3    # runs per thread count when measuring step costs
ROUNDS = 7     # interleaved timing rounds, staged against sequential
GAIN = 0.97    # the stages are kept when they take at most this fraction of the time


class NotAdmitted(Exception):
    """The call's inputs are not the kind the native plan was recorded with: decide on
    another call."""


class StagingWarning(UserWarning):
    """Running a graph's steps in concurrent stages failed; its calls run the steps one
    after another (same results)."""


@dataclass
class Staging:
    """One executor's stage schedule: decided at the first call on an active native plan.
    `adopt`: "faster" keeps the stages only when measured faster (what compile does);
    "always" keeps any valid schedule (the bench, to time each schedule as it is)."""
    schedule: str
    db: TuningDB | None = None
    adopt: str = "faster"
    decided: bool = False
    stages: list[st.Stage] | None = None   # over executor steps, when running
    step_names: list[str] = field(default_factory=list)
    estimate: float | None = None           # the schedule's estimated seconds
    sequential_estimate: float | None = None
    measured: tuple[float, float] | None = None  # (staged, sequential) medians, seconds
    stage_measured: list[float] | None = None   # one staged call, stage by stage
    stage_estimates: list[float] = field(default_factory=list)
    threads: int = 0
    reason: str = ""
    problem: st.Problem | None = None      # the steps and their measured costs
    recalled: bool = False                  # the costs came from the tuning database
    dump_to: Path | None = None              # the debug dump's file for `describe()`
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "sequential":
            self.decided, self.reason = True, "sequential (asked for)"

    def decide(self, executor, inputs: Sequence[torch.Tensor]) -> None:
        """Schedule, check and time the executor's steps (once; a call that meets another
        thread deciding runs on)."""
        if self.decided or not self._lock.acquire(blocking=False):
            return
        try:
            if not self.decided:
                self._decide(executor, list(inputs))
            self.decided = True
        except NotAdmitted:  # later, on a call the plan takes; meanwhile, step by step
            if executor.native.plan is not None:
                executor.native.plan.use_stages(False)
            return
        except Exception as err:  # noqa: BLE001  (the graph still runs, one step after another)
            plan = executor.native.plan
            if plan is not None:
                plan.use_stages(False)
            self.stages = None
            self.reason = f"sequential: staging failed ({type(err).__name__}: {err})"
            warn_once(f"opweave: graph @{executor.graph.name} runs its steps one after "
                      f"another: {self.reason}", StagingWarning)
            self.decided = True
        finally:
            self._lock.release()
        if self.decided and self.dump_to is not None:
            try:
                atomic_write(self.dump_to,
                             lambda tmp: tmp.write_text("\n".join(self.describe()) + "\n"))
            except OSError as err:
                warn_once(f"opweave: the debug dump could not write {self.dump_to}: {err}",
                          StagingWarning)

    def stale(self) -> bool:
        """Whether the stages were decided for another thread count than torch uses now
        (`torch.set_num_threads` since): then they are decided again."""
        return self.decided and self.threads != 0 and torch.get_num_threads() != self.threads

    def reset(self, plan) -> None:
        """Back to undecided, calls running step by step meanwhile."""
        if plan is not None:
            plan.use_stages(False)
        self.decided, self.stages, self.problem, self.measured = False, None, None, None
        self.estimate = self.sequential_estimate = self.stage_measured = None

    def _decide(self, executor, inputs: list[torch.Tensor]) -> None:
        plan, layout = executor.native.plan, executor.native.layout
        self.threads = cores = torch.get_num_threads()
        self.step_names = step_names(executor)
        why = _unschedulable(executor, layout, cores)
        if why:
            self.reason = f"sequential: {why}"
            return
        key = _key(executor, self.step_names, self.schedule, cores)
        record = self.db.get(KIND, key[0], _target()) if self.db is not None else None
        costs = _recorded_costs(record, len(self.step_names))
        self.recalled = costs is not None
        if record is not None and record.config.get("form") == "sequential" \
                and record.samples.get("staged") and self.adopt == "faster":
            staged_s = min(record.samples.get("staged") or [float("nan")])
            self.reason = (f"sequential: the {self.schedule} schedule measured "
                           f"{_ms(staged_s)} against {_ms(record.seconds)} one step after "
                           f"another here before (tuning database)")
            return
        if costs is None:
            costs = measure_costs(plan, layout, inputs, shares(cores))
        self.problem = problem = step_problem(executor, costs, cores, measure_sync(cores))
        schedule = st.critical_path(problem) if self.schedule == "critical-path" \
            else st.ios(problem)
        invalid = st.valid(problem, schedule)
        if invalid:
            raise RuntimeError(f"the scheduler made an invalid schedule: {invalid}")
        self.estimate = st.latency(problem, schedule)
        self.sequential_estimate = st.latency(problem, st.sequential(problem))
        self.stage_estimates = [st.stage_seconds(problem, s) for s in schedule]
        if all(len(s.groups) == 1 for s in schedule):
            self.reason = (f"sequential: the {self.schedule} schedule runs no steps "
                           f"concurrently on these costs")
            self._remember(key, "sequential", costs, {}, [])
            return
        install(plan, layout, schedule, inputs, cores)
        split = _recorded_split(record)
        if split is None:  # measure the stages as they run; split those that lost
            split = losing_stages(problem, schedule, measure_stages(plan, layout, inputs,
                                                                    len(schedule)))
        if split:
            schedule = refine(schedule, split, cores)
            self.estimate = st.latency(problem, schedule)
            self.stage_estimates = [st.stage_seconds(problem, s) for s in schedule]
            if all(len(s.groups) == 1 for s in schedule):
                plan.use_stages(False)
                self.reason = (f"sequential: each concurrent stage of the {self.schedule} "
                               f"schedule measured slower than its steps one after another")
                self._remember(key, "sequential", costs, {}, split)
                return
            install(plan, layout, schedule, inputs, cores)
        if record is not None and record.config.get("form") == "staged":
            self._start(plan, layout, schedule, inputs,
                        "staged: measured faster before (tuning database)")
            return
        staged_s, sequential_s = interleaved(plan, inputs, ROUNDS)
        self.measured = (staged_s, sequential_s)
        faster = staged_s <= GAIN * sequential_s
        if faster or self.adopt == "always":
            self._start(plan, layout, schedule, inputs,
                        f"staged: {_ms(staged_s)} against {_ms(sequential_s)} one step after another"
                        + ("" if faster else " (kept as asked, though not faster)"))
        else:
            plan.use_stages(False)
            self.reason = (f"sequential: the {self.schedule} schedule measured {_ms(staged_s)}, "
                           f"one step after another {_ms(sequential_s)}")
        if self.adopt == "faster":
            self._remember(key, "staged" if faster else "sequential", costs,
                           {"staged": [staged_s], "sequential": [sequential_s]}, split)

    def _start(self, plan, layout, schedule, inputs, reason: str) -> None:
        plan.use_stages(True)
        self.stages = schedule
        first = 1 if layout.step_starts[0] > 0 else 0  # a stage of what precedes the steps
        ran = plan.run_stages(inputs)
        self.stage_measured = ran[1][first:first + len(schedule)] if ran is not None else []
        self.reason = reason

    def _remember(self, key, form: str, costs: dict[int, list[float]], samples,
                  split: list[tuple[int, ...]] | None = None) -> None:
        if self.db is None:
            return
        descriptor = describe_target()
        # unmeasured (decided on the costs alone): the steps' estimated sequential time
        seconds = min(samples[form]) if samples.get(form) else max(sum(costs[max(costs)]), 1e-9)
        config = {"form": form, "costs": {str(t): c for t, c in costs.items()},
                  "split": [list(steps) for steps in split or []]}
        self.db.put(Record(KIND, key[0], target_id(descriptor), key[1], config, seconds,
                           samples), descriptor)

    def describe(self) -> list[str]:
        """What `explain` prints: the decision, then each concurrent stage's groups with
        their threads and the estimated against the measured stage time."""
        if not self.decided:
            return [f"stages ({self.schedule}): decided at the first call on the native plan"]
        lines = [f"stages ({self.schedule}, {self.threads} threads): {self.reason}"
                 + (" [step costs from the tuning database]" if self.recalled else "")]
        if self.estimate is not None:
            lines.append(f"  estimated {_ms(self.estimate)} against {_ms(self.sequential_estimate)} "
                         "one step after another (step costs measured in place)")
        if self.stages is None:
            return lines
        measured = self.stage_measured or []
        concurrent = [k for k, s in enumerate(self.stages) if len(s.groups) > 1]
        lines.append(f"  {len(self.stages)} stages, {len(concurrent)} of them concurrent:")
        for k in concurrent:
            stage = self.stages[k]
            got = measured[k] if k < len(measured) else None
            groups = " | ".join(
                f"{' -> '.join(self.step_names[i] for i in g)} ({t} thr)"
                for g, t in zip(stage.groups, stage.threads))
            lines.append(f"  stage {k}: {groups}; estimated {_ms(self.stage_estimates[k])}"
                         + (f", measured {_ms(got)}" if got is not None else ""))
        return lines


def step_names(executor) -> list[str]:
    steps = executor.lowered_steps
    if steps is not None:
        return [s.name or s.kind for s in steps]
    return [n.op for n in executor.graph.nodes if n.op != "constant"]


def shares(cores: int) -> list[int]:
    """The thread counts a step may run on: every thread alone, one in a concurrent stage
    (the native plan gives each concurrent group one thread of its OpenMP team)."""
    return sorted({cores, 1}, reverse=True)


def measure_costs(plan, layout, inputs, threads: Sequence[int],
                  repeats: int = REPEATS) -> dict[int, list[float]]:
    """Each step's seconds at each thread count: the plan run step by step on t threads,
    `repeats` times, the median per step."""
    costs = {}
    n = len(layout.step_starts) - 1
    for t in threads:
        runs = []
        for _ in range(repeats):
            seconds = plan.timed(inputs, t)
            if seconds is None:
                raise NotAdmitted()
            runs.append([sum(seconds[i] for i in layout.step_range(k)) for k in range(n)])
        costs[t] = [statistics.median(r[k] for r in runs) for k in range(n)]
    return costs


def measure_sync(cores: int) -> float:
    """Seconds a concurrent stage costs beyond its slowest group: one fork and join of
    `cores` empty groups on the native plan's threads (the median of 200)."""
    from ..runtime import native

    return native.loaded().fork_join_seconds(cores, 200)


def step_problem(executor, costs: dict[int, list[float]], cores: int,
                 sync: float) -> st.Problem:
    """The executor's steps as a scheduling problem: a step follows the steps that made
    what it reads, and a step that writes a slot (again, or into an input's storage)
    follows every step that read the slot before (so no reader sees the new bytes)."""
    preds: list[set[int]] = []
    writer: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    for k, (_, ins, outs, _) in enumerate(executor._steps):
        mine = {writer[s] for s in ins if s in writer}
        for s in ins:
            readers.setdefault(s, set()).add(k)
        overwrite = executor.overwritten[k]
        for s in [*outs, *([overwrite] if overwrite is not None else [])]:
            mine |= readers.get(s, set()) - {k}
            if s in writer:
                mine.add(writer[s])
        for s in outs:
            writer[s] = k
            readers[s] = set()
        preds.append(mine)
    available = sorted(costs)

    def seconds(step: int, threads: int) -> float:
        t = max((a for a in available if a <= threads), default=available[-1])
        return costs[t][step]

    return st.Problem([frozenset(p) for p in preds], seconds, cores, sync, group_threads=1)


def plan_stages(schedule: Sequence[st.Stage], layout, cores: int):
    """The native plan's stages for a schedule over steps: each group's instructions (its
    steps' in order) with the slots each drops after it, and per stage the slots dropped
    once its groups are all done. Instructions before the first step and after the last
    (copies of outputs) get stages of their own."""
    blocks: list[list[tuple[list[int], int]]] = []  # stage -> groups (instructions, threads)
    before = list(range(0, layout.step_starts[0]))
    if before:
        blocks.append([(before, cores)])
    for stage in schedule:
        blocks.append([([i for k in g for i in layout.step_range(k)], t)
                       for g, t in zip(stage.groups, stage.threads)])
    after = list(range(layout.step_starts[-1], layout.instructions))
    if after:
        blocks.append([(after, cores)])
    last: dict[int, tuple[int, int, int]] = {}       # slot -> (stage, group, position)
    groups_of: dict[tuple[int, int], set[int]] = {}  # (slot, stage) -> groups touching it
    for k, stage in enumerate(blocks):
        for g, (instructions, _) in enumerate(stage):
            for p, i in enumerate(instructions):
                for s in layout.touched[i]:
                    if s >= 0:
                        last[s] = (k, g, p)
                        groups_of.setdefault((s, k), set()).add(g)
    frees = [[[[] for _ in instructions] for instructions, _ in stage] for stage in blocks]
    stage_frees: list[list[int]] = [[] for _ in blocks]
    for s, (k, g, p) in last.items():
        if s in layout.keep:
            continue
        if len(groups_of[(s, k)]) > 1:
            stage_frees[k].append(s)
        else:
            frees[k][g][p].append(s)
    spec = [[(instructions, frees[k][g], threads) for g, (instructions, threads) in enumerate(stage)]
            for k, stage in enumerate(blocks)]
    return spec, stage_frees


def install(plan, layout, schedule: Sequence[st.Stage], inputs, cores: int) -> None:
    """Set `schedule`'s stages on the plan and run them, checked against the plan run
    step by step on the same inputs; the stages stay in use."""
    spec, stage_frees = plan_stages(schedule, layout, cores)
    plan.set_stages(spec, stage_frees)  # calls run step by step until checked
    sequential_out = plan.run(inputs)
    if sequential_out is None:
        raise NotAdmitted()
    ran = plan.run_stages(inputs)
    mismatch = _disagreement(sequential_out, ran[0] if ran is not None else None)
    if mismatch:
        raise RuntimeError(f"the staged plan disagrees with the sequential one ({mismatch})")
    plan.use_stages(True)


def measure_stages(plan, layout, inputs, stages: int, repeats: int = REPEATS) -> list[float]:
    """Each of the plan's `stages` stages' median seconds as it runs them (the stages of
    instructions around the steps left out)."""
    first = 1 if layout.step_starts[0] > 0 else 0
    runs = [(ran[1] if ran is not None else [])[first:first + stages]
            for ran in (plan.run_stages(inputs) for _ in range(repeats))]
    if any(len(r) != stages for r in runs):
        raise NotAdmitted()
    return [statistics.median(r[k] for r in runs) for k in range(stages)]


def losing_stages(problem: st.Problem, schedule: Sequence[st.Stage],
                  measured: Sequence[float]) -> list[tuple[int, ...]]:
    """The concurrent stages that took longer, measured as they ran, than their steps one
    after another on every thread take (IOS measures each stage it keeps; here the
    estimate picks them and their measurement vetoes)."""
    return [stage.steps for stage, took in zip(schedule, measured)
            if len(stage.groups) > 1
            and took > sum(problem.seconds(i, problem.cores) for i in stage.steps)]


def refine(schedule: Sequence[st.Stage], split: Sequence[tuple[int, ...]],
           cores: int) -> list[st.Stage]:
    """`schedule` with the concurrent stages of `split` (by their steps) run one step after
    another on every thread instead: group by group, each group's steps in order, which
    keeps every dependence (the groups of a stage are independent)."""
    lost = {tuple(steps) for steps in split}
    refined = []
    for stage in schedule:
        if len(stage.groups) > 1 and stage.steps in lost:
            refined.extend(st.Stage(((i,),), (cores,)) for g in stage.groups for i in g)
        else:
            refined.append(stage)
    return refined


def interleaved(plan, inputs, rounds: int) -> tuple[float, float]:
    """(staged, sequential) median seconds per call, alternating the two."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for staged in ((True, False) if r % 2 == 0 else (False, True)):
            plan.use_stages(staged)
            start = time.perf_counter()
            plan.run(inputs)
            times[staged].append(time.perf_counter() - start)
    return statistics.median(times[True]), statistics.median(times[False])


def _unschedulable(executor, layout, cores: int) -> str | None:
    if cores < 2:
        return "one thread: nothing to run side by side"
    if layout is None or len(layout.step_starts) != len(executor._steps) + 1:
        return "the native plan's record does not say which instructions are whose step"
    for nodes in executor.step_nodes():
        for n in nodes:
            if n.opdef.is_random:
                return f"{n.op} draws random numbers, whose order concurrent steps would change"
    return None


def _key(executor, names: list[str], schedule: str, cores: int) -> tuple[str, str]:
    digest, summary = graph_key(executor.graph)
    return tune.workload(KIND, (digest, tuple(names), schedule, cores))[0], \
        f"{schedule} stages of {summary}, {len(names)} steps, {cores} threads"


def _target() -> str:
    return target_id(describe_target())


def _recorded_costs(record, steps: int) -> dict[int, list[float]] | None:
    """The step costs a record holds, if they fit this graph's steps."""
    if record is None:
        return None
    try:
        costs = {int(t): [float(x) for x in c] for t, c in record.config["costs"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if not costs or any(len(c) != steps for c in costs.values()):
        return None
    return costs


def _recorded_split(record) -> list[tuple[int, ...]] | None:
    """The stages a record says were split after measuring (None: measure them)."""
    if record is None:
        return None
    try:
        return [tuple(int(i) for i in steps) for steps in record.config["split"]]
    except (KeyError, TypeError, ValueError):
        return None


def _disagreement(expected, got) -> str | None:
    """Where two runs' outputs differ by more than summation order does (a step on fewer
    threads may add in another order)."""
    if expected is None or got is None:
        return "the inputs were not the recorded kind"
    if len(expected) != len(got):
        return f"{len(got)} outputs, expected {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, got)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is {tuple(b.shape)} {b.dtype}, expected {tuple(a.shape)} {a.dtype}"
        if torch.equal(a, b):
            continue
        if not a.is_floating_point():
            return f"output {i} differs"
        scale = max(1.0, float(a.abs().max())) if a.numel() else 1.0
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale, equal_nan=True):
            return f"output {i} differs by {float((a - b).abs().max()):.3g}"
    return None


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3f} ms"
