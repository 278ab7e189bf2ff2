"""The tuning database: every measured choice, remembered per workload and machine.

SQLite (a file, WAL mode, so several processes tuning at once each commit whole records;
a process killed mid-write leaves the last committed state, by SQLite's atomic commit).
A record is keyed by (kind, workload, target): `kind` names the decision ("library-form":
an anchor group's oneDNN/MKL/reference form; "gemm-form": the GEMM of two run-time
matrices), `workload` is a hash of what is measured (ops, shapes, dtypes, strides,
attributes; `workload_text` keeps it readable), `target` the hash of the machine
(`target.describe`). It holds the chosen configuration (JSON) and every sample (seconds
per candidate). Nothing is pickled. A file that is not a valid database, or of a schema
this code does not know, is moved aside with one warning and a new one started: a
cache must never stop a compile. A row that does not parse is deleted, with a warning.

`export`/`import_` move records as JSON lines, so a database tuned on one machine can be
shared (Lorien); imported records keep their own target and are used only on a machine
with the same target.
"""
from __future__ import annotations

import json
import math
import os
import sqlite3
import time
import warnings
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from ..files import atomic_write

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS targets (target TEXT PRIMARY KEY, descriptor TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    kind TEXT NOT NULL,
    workload TEXT NOT NULL,
    target TEXT NOT NULL,
    workload_text TEXT NOT NULL,
    config TEXT NOT NULL,
    seconds REAL NOT NULL,
    samples TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (kind, workload, target)
);
"""


class TuningDBWarning(UserWarning):
    """The tuning database was damaged or of another schema; it was moved aside."""


class TuningDBError(ValueError):
    """A tuning database file or export that cannot be used; the message says why."""


@dataclass(frozen=True)
class Record:
    kind: str
    workload: str
    target: str
    workload_text: str
    config: dict
    seconds: float
    samples: dict[str, list[float]]
    created: float = 0.0

    def check(self) -> None:
        """Raise TuningDBError unless every field has the type and range it must."""
        if not all(isinstance(x, str) and x for x in (self.kind, self.workload, self.target)):
            raise TuningDBError("kind, workload and target must be non-empty strings")
        if not isinstance(self.config, dict):
            raise TuningDBError("config must be an object")
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds)
                and self.seconds > 0):
            raise TuningDBError(f"seconds must be finite and positive, not {self.seconds!r}")
        if not isinstance(self.samples, dict) or not all(
                isinstance(v, list) and all(isinstance(t, (int, float)) and math.isfinite(t)
                                            and t >= 0 for t in v)
                for v in self.samples.values()):
            raise TuningDBError("samples must map each candidate to a list of seconds")


class TuningDB:
    """One database file. Each operation opens its own short-lived connection, so a DB
    object is safe to use from threads and from forked worker processes."""

    def __init__(self, path: "str | os.PathLike"):
        self.path = Path(path)
        self._ready = False

    # -- opening, checking, moving aside --------------------------------------------------
    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        if not self._ready:
            self._prepare()
        with closing(sqlite3.connect(self.path, timeout=60.0)) as conn:
            with conn:  # one transaction: committed whole, or rolled back
                yield conn

    def _prepare(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        problem = self._problem()
        if problem:
            self._move_aside(problem)
        with closing(sqlite3.connect(self.path, timeout=60.0)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            with conn:
                conn.executescript(_SCHEMA)
                conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                             (str(SCHEMA_VERSION),))
        self._ready = True

    def _problem(self) -> str:
        """Why the existing file cannot be used ('' when it can, or does not exist)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return ""
        try:
            with closing(sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                         timeout=60.0)) as conn:
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    return f"integrity check failed ({check})"
                tables = {r[0] for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type='table'")}
                if "meta" not in tables:
                    return "not an opweave tuning database (no meta table)"
                row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as err:
            return f"not a readable SQLite database ({err})"
        version = row[0] if row else None
        if version != str(SCHEMA_VERSION):
            return f"schema version {version}, this opweave reads version {SCHEMA_VERSION}"
        return ""

    def _move_aside(self, problem: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{os.getpid()}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(str(self.path) + suffix)
            if part.exists():
                os.replace(part, Path(str(aside) + suffix))
        warnings.warn(f"opweave: tuning database {self.path}: {problem}; moved it to {aside} "
                      f"and started a new one (choices will be measured again)",
                      TuningDBWarning, stacklevel=4)

    # -- records --------------------------------------------------------------------------
    def get(self, kind: str, workload: str, target: str) -> Record | None:
        with self._connect() as conn:
            row = conn.execute("SELECT * FROM records WHERE kind=? AND workload=? AND target=?",
                               (kind, workload, target)).fetchone()
            if row is None:
                return None
            try:
                return _record(row)
            except (TuningDBError, ValueError, TypeError) as err:
                conn.execute("DELETE FROM records WHERE kind=? AND workload=? AND target=?",
                             (kind, workload, target))
                warnings.warn(f"opweave: tuning database {self.path}: a {kind} record did not "
                              f"parse ({err}); removed it", TuningDBWarning, stacklevel=3)
                return None

    def put(self, record: Record, descriptor: dict | None = None) -> None:
        record.check()
        with self._connect() as conn:
            if descriptor is not None:
                conn.execute("INSERT OR IGNORE INTO targets VALUES (?, ?)",
                             (record.target, json.dumps(descriptor, sort_keys=True)))
            conn.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (record.kind, record.workload, record.target, record.workload_text,
                          json.dumps(record.config, sort_keys=True), float(record.seconds),
                          json.dumps(record.samples, sort_keys=True),
                          record.created or time.time()))

    def records(self, target: str | None = None) -> list[Record]:
        with self._connect() as conn:
            query, args = "SELECT * FROM records", ()
            if target is not None:
                query, args = query + " WHERE target=?", (target,)
            rows = conn.execute(query + " ORDER BY kind, workload, target", args).fetchall()
        out = []
        for row in rows:
            try:
                out.append(_record(row))
            except (TuningDBError, ValueError, TypeError):
                continue  # `get` reports and removes it when it is asked for
        return out

    def targets(self) -> dict[str, dict]:
        with self._connect() as conn:
            return {t: json.loads(d) for t, d in conn.execute("SELECT * FROM targets")}

    def stats(self) -> dict[str, dict[str, int]]:
        """target -> kind -> number of records."""
        with self._connect() as conn:
            rows = conn.execute("SELECT target, kind, COUNT(*) FROM records GROUP BY target, kind")
            out: dict[str, dict[str, int]] = {}
            for target, kind, n in rows:
                out.setdefault(target, {})[kind] = n
            return out

    # -- sharing --------------------------------------------------------------------------
    def export(self, path: "str | os.PathLike") -> int:
        """Write every record (and the targets they were measured on) as JSON lines."""
        targets, records = self.targets(), self.records()
        lines = [json.dumps({"target": t, "descriptor": d}, sort_keys=True)
                 for t, d in sorted(targets.items())]
        lines += [json.dumps({"record": asdict(r)}, sort_keys=True) for r in records]
        atomic_write(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines)))
        return len(records)

    def import_(self, path: "str | os.PathLike") -> int:
        """Add the records of an export; an invalid line is refused with its number, and
        nothing of the file is added then."""
        descriptors, records = {}, []
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    if "record" in item:
                        record = Record(**item["record"])
                        record.check()
                        records.append(record)
                    elif "target" in item and isinstance(item.get("descriptor"), dict):
                        descriptors[item["target"]] = item["descriptor"]
                    else:
                        raise TuningDBError("neither a record nor a target")
                except (ValueError, TypeError) as err:
                    raise TuningDBError(f"{path}:{number}: not a tuning record ({err})") from None
        for record in records:
            self.put(record, descriptors.get(record.target))
        return len(records)


def _record(row) -> Record:
    kind, workload, target, text, config, seconds, samples, created = row
    record = Record(kind, workload, target, text, json.loads(config), seconds,
                    json.loads(samples), created)
    record.check()
    return record
