"""The profile as a terminal table and as a Chrome/Perfetto trace (JSON trace events)."""
from __future__ import annotations

import json
from pathlib import Path

from ..files import atomic_write
from ..ir import provenance
from .record import KINDS


def header(prof) -> list[str]:
    rec = prof.recording
    extra, per_step = prof.overhead
    python = rec.median(rec.python_ns)
    m = prof.machine
    roof = (f"{m.flops / 1e9:.0f} GFLOP/s, {m.bandwidth / 1e9:.1f} GB/s DRAM"
            + (f", {m.cache_bandwidth / 1e9:.0f} GB/s within {m.cache_bytes / 2 ** 20:.2f} MiB"
               if m.cache_bandwidth else "")
            + f", {m.launch * 1e6:.1f} us per step")
    return [
        f"opweave profile of {prof.name}: {rec.calls} profiled calls; times are the mean of "
        f"the {len(rec.kept)} at or below the median (noise only adds time)",
        prof.cpu,
        f"total {prof.levels.total * 1e3:.3f} ms per profiled call (median "
        f"{rec.median(rec.call_ns) * 1e3:.3f}); as run normally {rec.median(rec.plain_ns) * 1e3:.3f} ms "
        f"(median), Python steps untimed {python * 1e3:.3f} ms",
        _cost_line(extra, per_step, python, rec.timed_per_call),
        f"roofline: {roof} ({prof.machine_source})",
    ]


def _cost_line(extra: float, per_step: float, python: float, steps: int) -> str:
    if extra <= 0:
        return (f"profiling cost: below this machine's noise (timed calls were "
                f"{-extra * 1e3:.3f} ms faster than untimed ones); {steps} timed steps per call")
    return (f"profiling cost: {extra * 1e3:.3f} ms per call ({extra / python * 100:.1f}%), "
            f"{per_step * 1e6:.2f} us per timed step, {steps} timed steps per call")


def table(prof, top: int = 15) -> str:
    lv = prof.levels
    lines = header(prof)
    lines += ["", f"top {top} steps (of {len(lv.sites)} that took time):",
              f"{'ms/call':>9} {'share':>6}  {'bound':<8} {'%roof':>5} {'GFLOP/s':>8} "
              f"{'GB/s':>7}  step"]
    by_label = {s.label: s for s in prof.recording.sites}
    for row in lv.sites[:top]:
        site = by_label[row.key]
        roof = prof.roofs.get(site.index)
        if roof is not None and roof.bound:
            figures = f"{roof.bound:<8} {roof.achieved * 100:5.0f} {roof.gflops:8.1f} {roof.gbytes:7.1f}"
        else:
            figures = f"{'-':<8} {'':>5} {'':>8} {'':>7}"
        lines.append(f"{row.seconds * 1e3:9.3f} {row.share * 100:5.1f}%  {figures}  "
                     f"{_clip(row.key, 70)} ({KINDS[site.kind]})")
    for title, rows in (("source lines", lv.lines), ("modules", lv.modules)):
        lines += ["", f"top {top} {title} (of {len(rows)}):"]
        for row in rows[:top]:
            lines.append(f"{row.seconds * 1e3:9.3f} {row.share * 100:5.1f}%  {_clip(row.key, 90)}"
                         f"  [{row.sites} step(s)]")
    sums = ", ".join(f"{name} {sum(r.seconds for r in rows) * 1e3:.3f}"
                     for name, rows in lv.all().items())
    lines += ["", f"each level adds up to the measured total (ms per call): {sums}",
              "a step computing several IR nodes splits its time by their FLOPs share "
              "(bytes share where it does no arithmetic)"]
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def trace_events(prof) -> list[dict]:
    """One process, one track (the thread that runs the steps; the kernels' OpenMP
    threads are inside each step), a slice per call and per step, times in us."""
    rec = prof.recording
    sites = rec.sites
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": f"opweave: {prof.name}"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
         "args": {"name": "steps (kernels run their OpenMP threads inside)"}},
    ]
    calls: dict[int, list[int]] = {}
    for e in rec.events:
        span = calls.setdefault(e.call, [e.start, e.end])
        span[0], span[1] = min(span[0], e.start), max(span[1], e.end)
    for call, (start, end) in sorted(calls.items()):
        events.append({"name": f"call {call}", "cat": "call", "ph": "X", "pid": 1, "tid": 1,
                       "ts": start / 1e3, "dur": (end - start) / 1e3})
    for e in rec.events:
        site = sites[e.site]
        args = {"kind": KINDS[site.kind]}
        if site.graph:
            args["graph"] = site.graph
        if site.nodes:
            args["IR nodes"] = ", ".join(f"%{n.outputs[0].name} = {n.op}" for n in site.nodes)
            lines = sorted({provenance.parse(n.source).location for n in site.nodes} - {""})
            if lines:
                args["source"] = ", ".join(lines)
        elif site.source:
            args["source"] = provenance.parse(site.source).location
        events.append({"name": site.name, "cat": site.kind, "ph": "X", "pid": 1, "tid": 1,
                       "ts": e.start / 1e3, "dur": (e.end - e.start) / 1e3, "args": args})
    return events


def write_trace(prof, path: Path) -> Path:
    data = {"traceEvents": trace_events(prof), "displayTimeUnit": "ms",
            "otherData": {"model": prof.name, "cpu": prof.cpu}}
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data)))
    return path
