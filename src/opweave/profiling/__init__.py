"""Profiling: where a compiled model's time goes, on every level from the generated
kernel up to the user's source line and module (Tailored Profiling, EuroSys'21).

    prof = opweave.profile(compiled, inputs)   # opweave.compile(...) or opweave.from_onnx(...)
    print(prof.table())
    prof.write_trace("trace.json")             # chrome://tracing, ui.perfetto.dev
    prof.write_html("report.html")             # one self-contained file

record.py times every step; attribute.py maps the times up the levels and against the
roofline; report.py writes the table and the trace; html.py the report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..cost import Machine
from .attribute import Levels, Roof, check_totals, levels, site_roof
from .record import Recording, Target, record


@dataclass
class Profile:
    name: str
    recording: Recording
    levels: Levels
    roofs: dict[int, Roof]          # site index -> its roofline figures
    machine: Machine
    machine_measured: bool          # from `opweave tune machine`, else the defaults
    cpu: str = ""
    programs: list = field(default_factory=list)  # the CompiledProgram profiled, if any

    @property
    def overhead(self) -> tuple[float, float]:
        """(seconds a profiled call takes over the same Python steps untimed, the same
        per timed step)."""
        rec = self.recording
        extra = rec.median(rec.call_ns) - rec.median(rec.python_ns)
        return extra, extra / max(rec.timed_per_call, 1)

    def table(self, top: int = 15) -> str:
        from .report import table

        return table(self, top)

    def write_trace(self, path) -> Path:
        from .report import write_trace

        return write_trace(self, Path(path))

    def write_html(self, path) -> Path:
        from .html import write_html

        return write_html(self, Path(path))


def profile(compiled, inputs: Sequence, *, runs: int = 10, warmup: int = 2,
            name: str | None = None) -> Profile:
    """Profile `compiled` (from `opweave.compile` or `opweave.from_onnx`) on `inputs`:
    `warmup` calls, then `runs` timed ones (each beside an untimed call, to state what
    the timers cost). The steps run from Python while profiled; see record.py."""
    target = _target(compiled, list(inputs), name)
    recording = record(target, runs, warmup)
    result = levels(recording)
    check_totals(result)
    machine, measured = _machine(recording)
    roofs = {s.index: site_roof(s, recording.site_seconds(s), machine)
             for s in recording.sites if s.ns}
    return Profile(target.name, recording, result, roofs, machine, measured, _cpu_line(),
                   [target.program] if target.program is not None else [])


def _target(compiled, inputs: list, name: str | None) -> Target:
    from ..frontends.torch_export import CompiledModel
    from ..onnx.model import OnnxModel

    if isinstance(compiled, CompiledModel):
        compiled(*inputs)  # the specialization these inputs run
        program = compiled.program
        return Target(lambda: compiled(*inputs), program=program, name=name or compiled.name)
    if isinstance(compiled, OnnxModel):
        graph, _ = compiled.compiled_for(*inputs)
        return Target(lambda: compiled(*inputs), graph=graph, name=name or compiled.label)
    raise TypeError(f"opweave.profile takes what opweave.compile or opweave.from_onnx "
                    f"returned, not {type(compiled).__name__}")


def _machine(recording: Recording) -> tuple[Machine, bool]:
    """The roofline `opweave tune machine` stored for this machine, else the defaults."""
    from .. import cost, tune
    from ..tune import roofline

    for graph in recording.graphs:
        db_path = graph.options.tuning_db if graph.options is not None else None
        try:
            machine = roofline.load(tune.open_db(db_path))
        except Exception:  # noqa: BLE001  (an unreadable database: the defaults)
            machine = None
        if machine is not None:
            return machine, True
    return cost.active(), False


def _cpu_line() -> str:
    import torch

    from ..bench import cpu

    return cpu.line(cpu.describe(torch.get_num_threads()))


__all__ = ["Profile", "profile"]
