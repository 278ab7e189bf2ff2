"""The fuzzing loop behind `opweave fuzz`: generate, draw inputs, check every path,
minimise and write each failure; a summary ends with the line `N passed, M failed`."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..files import atomic_write_bytes
from . import check, minimize, oracle, reproducer
from .generate import GenConfig, generate

PROGRESS_EVERY = 100
REDRAWS = 20  # graphs tried per slot before giving up on it (eager rejects the rest)


@dataclass
class FuzzConfig:
    graphs: int = 100
    seed: int = 0
    max_nodes: int = 8
    paths: tuple[str, ...] = check.PATHS
    out: str = "opweave-fuzz-failures"
    time_budget: float | None = None   # seconds; stop starting new graphs after it
    minimize: bool = True
    ops: tuple[str, ...] | None = None


@dataclass
class Failure:
    index: int
    seed: int
    outcome: check.Outcome
    nodes: int
    reproducer: Path | None = None


@dataclass
class Summary:
    passed: int = 0
    failed: int = 0
    skipped: int = 0  # graph slots where no graph was accepted by eager
    failures: list[Failure] = field(default_factory=list)
    paths: Counter = field(default_factory=Counter)  # (path, status) -> count
    ops: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def line(self) -> str:
        text = f"{self.passed} passed, {self.failed} failed"
        return text + (f", {self.skipped} skipped" if self.skipped else "")


def graph_seed(seed: int, index: int, redraw: int) -> int:
    return (seed * 1_000_003 + index) * 101 + redraw


def draw_case(seed: int, index: int, config: FuzzConfig) -> tuple[int, oracle.Case] | None:
    gen = GenConfig(max_nodes=config.max_nodes, ops=config.ops)
    for redraw in range(REDRAWS):
        s = graph_seed(seed, index, redraw)
        try:
            return s, oracle.draw(generate(s, gen), s)
        except oracle.Rejected:
            continue
    return None


def fuzz(config: FuzzConfig, log: Callable[[str], None] = print) -> Summary:
    summary = Summary()
    start = time.monotonic()
    created = bool(config.out) and not Path(config.out).exists()
    try:
        _loop(config, summary, start, log)
    except KeyboardInterrupt:  # the summary so far is still worth printing
        log("interrupted")
    summary.seconds = time.monotonic() - start
    if created and Path(config.out).is_dir() and not any(Path(config.out).iterdir()):
        Path(config.out).rmdir()  # only the running marker was ever written there
    return summary


def _loop(config: FuzzConfig, summary: Summary, start: float, log) -> None:
    for index in range(config.graphs):
        if index and index % PROGRESS_EVERY == 0:
            log(f"... {index} graphs: {summary.failed} failed ({time.monotonic() - start:.0f}s)")
        if config.time_budget is not None and time.monotonic() - start > config.time_budget:
            log(f"time budget of {config.time_budget:g}s spent after {index} graphs")
            break
        drawing = _mark_drawing(config, index)
        drawn = draw_case(config.seed, index, config)
        if drawing is not None:
            drawing.unlink(missing_ok=True)
        if drawn is None:
            summary.skipped += 1
            continue
        s, case = drawn
        summary.ops.update(n.op for n in case.graph.nodes)
        # a crash (a kernel's SIGSEGV or SIGFPE) takes the process: leave this graph behind
        running = _mark_running(config, case, s)
        outcomes = [check.check_path(check.RULES, case, s)]
        if not outcomes[0].failed:  # the other paths trust the rules
            outcomes = [check.check_path(path, case, s) for path in config.paths]
        for o in outcomes:
            summary.paths[o.path, o.status] += 1
        if running is not None:
            running.unlink(missing_ok=True)
        failed = [o for o in outcomes if o.failed]
        if not failed:
            summary.passed += 1
            continue
        summary.failed += 1
        failure = _record(index, s, case, failed[0], config)
        summary.failures.append(failure)
        where = f" -> {failure.reproducer}" if failure.reproducer else ""
        others = f" (also fails: {', '.join(o.path for o in failed[1:])})" if failed[1:] else ""
        log(f"FAIL graph {index} (seed {s}) {failure.outcome.path}: {failure.outcome.kind}: "
            f"{failure.outcome.message[:300]} [{failure.nodes} node(s)]{others}{where}")


RUNNING = "running-when-killed"
DRAWING = "drawing-when-killed.txt"


def _mark_drawing(config: FuzzConfig, index: int) -> Path | None:
    """Generating a graph and drawing its inputs run ops too (eager, on trial shapes), so a
    crash can come before there is a graph to write: leave how to draw it again."""
    if not config.out:
        return None
    path = Path(config.out) / DRAWING
    atomic_write_bytes(path, (
        f"graph {index} of `opweave fuzz --seed {config.seed} --max-nodes {config.max_nodes}` "
        "was being generated or drawn when the fuzzer died. Again, in a subprocess:\n"
        f"  python -X faulthandler -c 'from opweave.fuzz.runner import FuzzConfig, draw_case; "
        f"draw_case({config.seed}, {index}, FuzzConfig(max_nodes={config.max_nodes}, "
        f"ops={config.ops!r}))'\n").encode())
    return path


def _mark_running(config: FuzzConfig, case: oracle.Case, seed: int) -> Path | None:
    if not config.out:
        return None
    return reproducer.write(config.out, RUNNING, case, path=(check.RULES,) + tuple(config.paths),
                            seed=seed, kind="running",
                            message="this graph was being checked when the fuzzer died")


def _record(index: int, seed: int, case: oracle.Case, outcome: check.Outcome,
            config: FuzzConfig) -> Failure:
    """Minimise the first failing path's case and write its reproducer."""
    if config.minimize:
        case = minimize.minimize(case, lambda c: same_failure(check.check_path(outcome.path, c, seed),
                                                              outcome))
        again = check.check_path(outcome.path, case, seed)
        if again.failed:
            outcome = again
    path = None
    if config.out:
        path = reproducer.write(config.out, f"fuzz-{seed}-{outcome.path}", case, path=outcome.path,
                                seed=seed, kind=outcome.kind, message=outcome.message)
    return Failure(index, seed, outcome, minimize.size(case), path)


def same_failure(got: check.Outcome, want: check.Outcome) -> bool:
    return got.failed and got.kind == want.kind


def report(summary: Summary, config: FuzzConfig) -> str:
    """The closing lines: per-path counts, time, then `N passed, M failed`."""
    lines = []
    for path in config.paths:
        counts = {s: summary.paths[path, s] for s in ("pass", "fail", "skip")}
        lines.append(f"  {path}: {counts['pass']} passed, {counts['fail']} failed, "
                     f"{counts['skip']} not applicable")
    lines.insert(0, f"{summary.passed + summary.failed} graphs in {summary.seconds:.1f}s "
                    f"(seed {config.seed}, up to {config.max_nodes} nodes):")
    lines.append(summary.line())
    return "\n".join(lines)
