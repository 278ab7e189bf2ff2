"""The measured roofline in the tuning database: `opweave tune machine` measures this
machine's parameters (cost/machine.py) and stores them for its target; a compile with that
database costs its graphs with them instead of the defaults."""
from __future__ import annotations

import dataclasses
import time

from ..cost.model import Machine
from ..notices import warn_once
from .db import Record, TuningDB, TuningDBWarning
from .target import describe, target_id

KIND = "machine"
WORKLOAD = "roofline"


def store(db: TuningDB, machine: Machine, about: dict, seconds: float) -> None:
    """Keep `machine` for this target with the threads it was measured with (`about`),
    replacing the last one: compiles with that many threads use it."""
    machine.check()
    descriptor = describe(about.get("threads"))
    db.put(Record(KIND, WORKLOAD, target_id(descriptor), "the roofline's parameters",
                  {"machine": dataclasses.asdict(machine), "about": about},
                  max(seconds, 1e-9), {}, time.time()), descriptor)


def load(db: TuningDB | None) -> Machine | None:
    """The parameters stored for this machine, or None. A stored record that does not make
    a valid machine is reported once and ignored (the defaults are used)."""
    if db is None:
        return None
    record = db.get(KIND, WORKLOAD, target_id(describe()))
    if record is None:
        return None
    try:
        fields = record.config["machine"]
        machine = Machine(**{f.name: fields[f.name] for f in dataclasses.fields(Machine)})
        machine.check()
        return machine
    except (KeyError, TypeError, ValueError) as e:
        warn_once(f"opweave: the machine parameters stored in {db.path} are not usable ({e}); "
                  "graphs are costed with the defaults", TuningDBWarning)
        return None
