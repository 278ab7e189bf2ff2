"""What `opweave bench` writes: a terminal table, JSON with every raw sample, markdown
tables and a PNG chart of latency relative to eager."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from ..codegen.int8 import units as int8_units
from ..codegen.precision import units
from ..files import atomic_write, atomic_write_bytes
from . import cpu
from .harness import (LOW_PRECISION_REL_L2, REFERENCE, TOLERANCE, BenchResult, ModelResult,
                      low_precision)

MIB = 1 << 20


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.0f}"


def _backends(result: BenchResult) -> list[str]:
    return result.config.ordered_backends()


def summary_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Model rows, one column per backend: median ms and speed-up over eager."""
    backends = _backends(result)
    header = ["model", "GFLOP"] + backends
    rows = []
    for model in result.models:
        cells = [model.model, "-" if model.flops is None else f"{model.flops / 1e9:.3g}"]
        for backend in backends:
            entry = model.backends.get(backend)
            if entry is None or not entry.ok:
                cells.append("n/a" if entry is None or entry.status == "unavailable" else "error")
                continue
            mark = _marks(result, model, backend)
            speedup = model.speedup_over_eager(backend)
            cells.append(f"{_ms(entry.summary.median)}{mark}" if speedup is None or backend == REFERENCE
                         else f"{_ms(entry.summary.median)} ({speedup:.2f}x){mark}")
        rows.append(cells)
    geo = ["geomean vs eager", ""]
    for backend in backends:
        geo.append(_ratio(result.geomean_speedup(backend)))
    rows.append(geo)
    return header, rows


def _marks(result: BenchResult, model: ModelResult, backend: str) -> str:
    entry = model.backends[backend]
    marks = ""
    if entry.note:
        marks += "*"
    if entry.max_abs_diff is not None and not entry.accurate(TOLERANCE[result.config.mode]):
        marks += "!"
    return marks


def detail_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    peak = result.machine.get("gemm_peak_flops")
    header = ["model", "backend", "median ms", "min ms", "max ms", "vs eager", "setup s",
              "max abs diff", "rel L2 diff", "peak RSS MiB", "torch peak MiB", "% GEMM peak", "note"]
    rows = []
    for model in result.models:
        for backend in _backends(result):
            entry = model.backends.get(backend)
            if entry is None:
                continue
            if not entry.ok:
                rows.append([model.model, backend] + ["-"] * 10 + [f"{entry.status}: {entry.reason}"])
                continue
            s = entry.summary
            share = ("-" if not (peak and model.flops)
                     else f"{100 * model.flops / s.median / peak:.1f}")
            rows.append([model.model, backend, _ms(s.median), _ms(s.min), _ms(s.max),
                         _ratio(model.speedup_over_eager(backend)),
                         "-" if entry.setup_s is None else f"{entry.setup_s:.1f}",
                         "-" if entry.max_abs_diff is None else f"{entry.max_abs_diff:.1e}",
                         "-" if entry.rel_l2_diff is None else f"{entry.rel_l2_diff:.1e}",
                         _mib(entry.peak_rss), _mib(entry.torch_peak), share, entry.note])
    return header, rows


def _text_table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda cells: "  ".join(str(c).ljust(w) if i in (0, 1) or not _numeric(c)
                                   else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
                     + [line(r) for r in rows])


def _numeric(cell) -> bool:
    return str(cell)[:1].isdigit() or str(cell) in ("-", "n/a")


def _markdown_table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def _preamble(result: BenchResult) -> list[str]:
    c, m = result.config, result.machine
    peak = m.get("gemm_peak_flops")
    what = "training step (forward, backward, SGD)" if c.mode == "train" else "inference"
    lows = sorted({low_precision(b) for b in _backends(result)} - {None})
    precision = ", ".join(["fp32"] + [f"{p} where a backend is named *-{p}" for p in lows])
    return [f"{what}, batch {c.batch}, {precision}, {c.threads} threads on {m['cpu']} "
            f"({m['cpus']} cpus); median of {c.runs} interleaved runs after {c.warmup} warm-up"
            + (f"; each run {c.calls} calls" + ("" if c.pause_ms else " back to back")
               + ", its sample the mean of all but the first" if c.calls > 1 else "")
            + (f"; each call after a {c.pause_ms:g} ms pause of its process" if c.pause_ms
               else "")
            + ("; each call made by a second thread of its process, the one that prepared "
               "the model staying idle (a server's handler thread: docs/runtime.md)"
               if c.caller == "thread" else ""),
            cpu.line(m.get("cpu_info") or {}),
            f"fp32 GEMM peak: {peak / 1e9:.1f} GFLOP/s" if peak else "fp32 GEMM peak: -",
            "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)]


def _footnotes(result: BenchResult) -> list[str]:
    notes = ["(Nx) = eager median / backend median: above 1 is faster than eager.",
             f"! = outputs differ from eager by more than {TOLERANCE[result.config.mode]:g} "
             f"(left out of the geometric mean).",
             "Runs in Williams-square order; each run starts once the backend before it has "
             "let its threads go idle, "
             + (f"and each call after a further {result.config.pause_ms:g} ms pause, so each "
                "pays what a model served now and then pays: idle vCPUs' slow first work and "
                "its runtime's sleeping threads (docs/runtime.md)."
                if result.config.pause_ms else
                "so each pays the slow first work of idle vCPUs (about 0.2 ms on the KVM "
                "machines: docs/runtime.md; --calls N times calls made back to back)."
                if result.config.calls == 1 else
                "and its first call, which pays the slow first work of idle vCPUs "
                "(docs/runtime.md), is not counted.")]
    lows = {low_precision(b) for b in _backends(result)}
    if "bf16" in lows:
        notes.append(f"*-bf16 backends compute in bf16: held to a relative L2 difference "
                     f"from eager of {LOW_PRECISION_REL_L2['bf16']:g} instead; this CPU's bf16 "
                     f"units: {units()}.")
    if any(b.endswith("-bf16x3") for b in _backends(result)):
        notes.append(f"*-bf16x3 backends compute linear layers and convolutions from three "
                     f"bf16 parts where that measured faster, at float32's accuracy: held to "
                     f"float32's tolerance; this CPU's bf16 units: {units()}.")
    if "int8" in lows:
        notes.append(f"*-int8 backends compute linear layers and convolutions in int8, "
                     f"calibrated on the benchmark's inputs: held to a relative L2 difference "
                     f"from eager of {LOW_PRECISION_REL_L2['int8']:g} instead; this CPU's int8 "
                     f"units: {int8_units()}.")
    for model in result.models:
        if model.notes:
            notes.append(f"{model.model}: {model.notes}")
        for backend, entry in model.backends.items():
            if entry.note:
                notes.append(f"* {model.model} / {backend}: {entry.note}")
            if not entry.ok:
                notes.append(f"{model.model} / {backend} {entry.status}: {entry.reason}")
    return notes


PEERS_TITLE = ("opweave against each model's fastest other backend, round by round (its time "
               "as a multiple of the other's: below 1 is faster; 'level' where the interval "
               "holds 1):")


def peer_lines(result: BenchResult) -> list[str]:
    """One line per opweave backend and model: the median of its per-round time ratios
    to the model's fastest other backend, with the interval and verdict
    (`BenchResult.against_peers`)."""
    return [f"{model}: {p.backend} / {p.other}: {p.median:.3f} (median of {p.runs} rounds; "
            f"{p.coverage:.0%} interval {p.low:.3f}-{p.high:.3f}): {p.verdict}"
            for model, p in result.against_peers()]


def terminal(result: BenchResult) -> str:
    parts = _preamble(result) + ["", _text_table(*summary_rows(result)), ""]
    peers = peer_lines(result)
    if peers:
        parts += [PEERS_TITLE] + peers + [""]
    parts += _footnotes(result)
    return "\n".join(parts)


def markdown(result: BenchResult) -> str:
    parts = ["# opweave bench: " + result.config.mode, ""]
    parts += [f"- {line}" for line in _preamble(result)] + [""]
    parts += ["## Latency (median ms, speed-up over eager)", "", _markdown_table(*summary_rows(result)), ""]
    parts += [f"- {note}" for note in _footnotes(result)] + [""]
    peers = peer_lines(result)
    if peers:
        parts += ["## Against the fastest other backend", "", PEERS_TITLE, ""]
        parts += [f"- {line}" for line in peers] + [""]
    parts += ["## Details", "", _markdown_table(*detail_rows(result)), ""]
    parts += ["## Pairwise ratios (row backend's speed-up over column backend)", ""]
    for model in result.models:
        ratios = model.ratios()
        if len(ratios) < 2:
            continue
        names = list(ratios)
        rows = [[a] + [f"{ratios[a][b]:.2f}" for b in names] for a in names]
        parts += [f"### {model.model}", "", _markdown_table([""] + names, rows), ""]
    return "\n".join(parts)


def _finite(value):
    """JSON has no inf or NaN: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(result: BenchResult) -> dict:
    models = []
    for model in result.models:
        backends = {}
        for name, entry in model.backends.items():
            data = dataclasses.asdict(entry)
            summary = entry.summary
            data["summary"] = dataclasses.asdict(summary) if summary else None
            backends[name] = data
        models.append(dict(model=model.model, notes=model.notes, flops=model.flops,
                           backends=backends, ratios=model.ratios()))
    return _finite(dict(format="opweave-bench/1", config=dataclasses.asdict(result.config),
                machine=result.machine, models=models,
                geomean_speedup_over_eager={b: result.geomean_speedup(b) for b in _backends(result)},
                against_peers=[dict(model=model, **dataclasses.asdict(p), verdict=p.verdict)
                               for model, p in result.against_peers()]))


def write_chart(result: BenchResult, path: Path) -> None:
    """Grouped bars: each backend's latency relative to eager (lower is faster), per model,
    on a log scale so that 2x faster and 2x slower look alike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = _backends(result)
    names = [m.model for m in result.models]
    width = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(names) + 2), 4.2))
    relative = [1 / s for m in result.models for b in backends
                if (s := m.speedup_over_eager(b)) is not None]
    low = min(relative + [1.0]) / 1.5
    ax.set_yscale("log")
    for i, backend in enumerate(backends):
        for j, model in enumerate(result.models):
            x = j + (i - (len(backends) - 1) / 2) * width
            speedup = model.speedup_over_eager(backend)
            if speedup is None:
                ax.text(x, low * 1.1, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            ax.bar(x, 1 / speedup - low, width, bottom=low, color=f"C{i}",
                   label=backend if j == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylim(bottom=low)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("latency relative to eager (lower is faster)")
    ax.set_title(f"opweave bench ({result.config.mode}, batch {result.config.batch}, "
                 f"{result.config.threads} threads)")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, fontsize=8, ncols=max(len(labels), 1), loc="upper center",
              bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(result: BenchResult, out_dir: Path) -> dict[str, Path]:
    """Write JSON, markdown and PNG for `result` into `out_dir`, each atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{result.config.mode}"
    paths = {kind: out_dir / f"{stem}.{kind}" for kind in ("json", "md", "png")}
    atomic_write_bytes(paths["json"], json.dumps(to_json(result), indent=1).encode())
    atomic_write_bytes(paths["md"], markdown(result).encode())
    atomic_write(paths["png"], lambda tmp: write_chart(result, tmp))
    return paths
