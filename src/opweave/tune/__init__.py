"""Tuning: measured choices are remembered in a database (`db.TuningDB`) keyed by the
workload and the machine (`target`), so a warm compile measures nothing and compiles the
same plan every time. See docs/tuning.md.

The compiler asks through two calls: `recall(kind, key, candidates)` before measuring and
`remember(kind, key, chosen, samples)` after. Which database they use is the one the
pipeline activates for the compile (`using(open_db(Options.tuning_db))`); with none
active, choices are measured and kept for the process only.
"""
from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ..files import cache_root
from .db import Record, TuningDB, TuningDBError, TuningDBWarning
from .ranking import shortlist
from .target import describe, target_id

DEFAULT = "default"  # Options.tuning_db: the file under opweave's cache directory
_ACTIVE: ContextVar[TuningDB | None] = ContextVar("opweave_tuning_db", default=None)
_OPEN: dict[str, TuningDB] = {}


def default_path() -> Path:
    return cache_root() / "tuning.sqlite"


def open_db(path: "str | os.PathLike | None") -> TuningDB | None:
    """The database at `path` (DEFAULT: under the cache directory; None: none), one
    object per file for the process."""
    if path is None:
        return None
    resolved = str(default_path() if path == DEFAULT else Path(path))
    if resolved not in _OPEN:
        _OPEN[resolved] = TuningDB(resolved)
    return _OPEN[resolved]


@contextmanager
def using(db: TuningDB | None):
    token = _ACTIVE.set(db)
    try:
        yield db
    finally:
        _ACTIVE.reset(token)


def active() -> TuningDB | None:
    return _ACTIVE.get()


def workload(kind: str, key) -> tuple[str, str]:
    """(hash, readable text) of a decision's key: its repr, which names ops, shapes,
    dtypes, strides and attributes in a stable order."""
    text = f"{kind}:{key!r}"
    return hashlib.sha256(text.encode()).hexdigest()[:32], text


# The revision of the forms each kind of decision compares: a record made at an older
# one (its config's "revision", 1 where absent) is measured again, and not learned from.
# library-form 2: until then a linear layer with a residual add called its oneDNN form
# through torch's overload resolution, which cost 5 ms a call, so nearly every such
# record chose the reference form. 3: convolutions and linear layers gained the form
# "onednn-direct" (oneDNN's own library, codegen/onednn_direct.py). 4: linear layers of
# up to 16 rows gained "cpp-gemv" (codegen/gemv.py). 5: 3x3 convolutions of stride 1
# gained "onednn-winograd" (codegen/onednn_winograd.cpp). 6: under precision "bf16",
# convolutions and linear layers gained "onednn-direct" in bf16. 7: under precision
# "int8", they gained "onednn-int8-direct" (oneDNN's own int8 primitives).
# attention-form 2: the unfused form returns 0 for rows its mask hides entirely and
# counts the copy into the fused kernel's layout. 3: the "per-head" form
# (codegen/onednn_attention.cpp). (Its bf16 sibling "per-head-bf16" needed no revision:
# an attention's key names the forms it compares.)
REVISIONS = {"library-form": 7, "library-form-by-size-class": 7, "attention-form": 3}
# Revisions of one kind's decisions under one precision only (their keys hold
# ("precision", name)), so the others' records stay current. library-form 8 under "bf16":
# the bf16 forms are named "onednn-bf16", "onednn-direct-bf16", ... and are measured
# against the float32 forms, which keep their names (a bf16 record's "onednn-direct" had
# meant the bf16 form). 9: a group whose operand may arrive in bf16 measures its forms on
# that operand as they would read it (`choice.handed_bf16`), no longer on a float32 one.
# 10: a bf16 convolution whose residual is dead after it adds into it in place (oneDNN's
# sum post-op), no longer as a binary operand (codegen/library.forms), and a group whose
# residual may arrive in bf16 measures its forms on a bf16 residual.
PRECISION_REVISIONS = {("library-form", "bf16"): 10, ("library-form-by-size-class", "bf16"): 10}


def revision(kind: str, workload_text: str) -> int:
    """The revision of the forms a decision of `kind` keyed `workload_text` compares."""
    for (scoped, precision), number in PRECISION_REVISIONS.items():
        if scoped == kind and f"('precision', '{precision}')" in workload_text:
            return number
    return REVISIONS.get(kind, 1)


def is_current(record: Record) -> bool:
    """Whether `record` was measured on the forms its kind compares today."""
    return record.config.get("revision", 1) >= revision(record.kind, record.workload_text)


def _current(kind: str, key, db: TuningDB | None) -> Record | None:
    """The record of this workload on this machine, if it is current."""
    db = db or active()
    if db is None:
        return None
    record = db.get(kind, workload(kind, key)[0], target_id(describe()))
    return record if record is not None and is_current(record) else None


def recall(kind: str, key, candidates, db: TuningDB | None = None) -> tuple[str, float] | None:
    """The recorded choice for this workload on this machine, if it is current and still
    one of the `candidates`; None when it must be measured."""
    record = _current(kind, key, db)
    if record is None or record.config.get("form") not in candidates:
        return None
    return record.config["form"], record.seconds


def recorded_samples(kind: str, key, db: TuningDB | None = None) -> dict[str, list[float]]:
    """Every sample of the current record of this workload on this machine ({} if none)."""
    record = _current(kind, key, db)
    return dict(record.samples) if record is not None else {}


def remember(kind: str, key, chosen: str, samples: dict[str, list[float]],
             db: TuningDB | None = None) -> None:
    db = db or active()
    if db is None:
        return
    descriptor = describe()
    wid, text = workload(kind, key)
    seconds = min(samples[chosen])
    config = {"form": chosen}
    if kind in REVISIONS:
        config["revision"] = revision(kind, text)
    db.put(Record(kind, wid, target_id(descriptor), text, config, seconds, samples), descriptor)


__all__ = ["TuningDB", "Record", "TuningDBError", "TuningDBWarning", "open_db", "using",
           "active", "is_current", "recall", "recorded_samples", "remember", "revision",
           "REVISIONS", "PRECISION_REVISIONS", "shortlist", "workload",
           "DEFAULT", "default_path"]
