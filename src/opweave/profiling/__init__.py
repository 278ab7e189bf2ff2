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

from dataclasses import dataclass
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
    machine_source: str             # where its figures come from, in words
    cpu: str = ""

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
            name: str | None = None, measure_machine: bool = False) -> Profile:
    """Profile `compiled` (from `opweave.compile`, also with `train=True`,
    `opweave.from_onnx` or `torch.compile(..., backend="opweave")`) on `inputs`:
    `warmup` calls, then `runs` timed ones (each beside an untimed call, to state what
    the timers cost). The steps run from Python while profiled; see record.py.
    The roofline is the one `opweave tune machine` stored; without one, measured now
    (not stored) with `measure_machine`, else the cost model's defaults."""
    import torch

    with torch.no_grad():  # the specialization the profiled (no-grad) calls take
        target = _target(compiled, list(inputs), name)
    recording = record(target, runs, warmup)
    result = levels(recording)
    check_totals(result)
    machine, source = _machine(recording, measure_machine)
    roofs = {s.index: site_roof(s, recording.site_seconds(s), machine)
             for s in recording.sites if s.ns}
    return Profile(target.name, recording, result, roofs, machine, source, _cpu_line())


def _target(compiled, inputs: list, name: str | None) -> Target:
    from torch._dynamo.eval_frame import OptimizedModule

    from ..frontends.torch_dynamo import compiled_graphs
    from ..frontends.torch_export import CompiledModel
    from ..frontends.training import TrainingModel
    from ..onnx.model import OnnxModel

    if isinstance(compiled, CompiledModel):
        compiled(*inputs)  # the specialization these inputs run
        programs = [compiled.program] if compiled.program is not None else []
        return Target(lambda: compiled(*inputs), programs, name=name or compiled.name)
    if isinstance(compiled, TrainingModel):  # the joint forward + backward step
        compiled(*inputs)
        return Target(lambda: compiled(*inputs), list(compiled.programs.values()),
                      name=name or compiled.name)
    if isinstance(compiled, OnnxModel):
        graph, _ = compiled.compiled_for(*inputs)
        return Target(lambda: compiled(*inputs), graph=graph, name=name or compiled.label)
    if isinstance(compiled, OptimizedModule):
        compiled(*inputs)  # Dynamo compiles what these inputs run
        # every live opweave program may be one this call runs; those it does not take no
        # time and appear nowhere
        return Target(lambda: compiled(*inputs), list(compiled_graphs),
                      name=name or type(compiled._orig_mod).__name__,
                      outside="torch.compile: Dynamo's guards and wrappers, and the code "
                              "between its graphs")
    raise TypeError(f"opweave.profile takes what opweave.compile, opweave.from_onnx or "
                    f"torch.compile(..., backend=\"opweave\") returned, not "
                    f"{type(compiled).__name__}")


def _machine(recording: Recording, measure: bool) -> tuple[Machine, str]:
    """The roofline and where it comes from (see `profile`). A roofline measured here is
    not stored: a profile must not change what later compiles cost their plans with
    (`opweave tune machine` stores one, measured on purpose on a quiet machine)."""
    from .. import cost, tune
    from ..cost.machine import measure as measure_now
    from ..tune import roofline

    db_path = next((g.options.tuning_db for g in recording.graphs if g.options is not None), None)
    try:
        stored = roofline.load(tune.open_db(db_path))
    except Exception:  # noqa: BLE001  (an unreadable database: as if it had nothing)
        stored = None
    if stored is not None:
        return stored, "measured by `opweave tune machine`"
    if measure:
        return measure_now()[0], "measured now; `opweave tune machine` would keep it"
    return cost.active(), "the cost model's defaults: run `opweave tune machine` to measure"


def _cpu_line() -> str:
    import torch

    from ..bench import cpu

    return cpu.line(cpu.describe(torch.get_num_threads()))


__all__ = ["Profile", "profile"]
