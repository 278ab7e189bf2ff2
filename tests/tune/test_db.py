"""The tuning database: records round-trip, survive concurrent writers and kill -9, a
damaged file or another schema is moved aside, export/import shares records, and records
of another machine are never taken as measurements here."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings

import pytest

from opweave import tune
from opweave.tune import Record, TuningDB, TuningDBError, TuningDBWarning
from opweave.tune.target import describe, target_id


def _record(i: int, target: str = "t0", seconds: float = 1e-3) -> Record:
    return Record("library-form", f"w{i}", target, f"workload {i}", {"form": "onednn"}, seconds,
                  {"onednn": [seconds, seconds * 1.1], "reference": [seconds * 2]})


def test_records_round_trip(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    db.put(_record(1), {"cpu": "x"})
    got = db.get("library-form", "w1", "t0")
    assert got.config == {"form": "onednn"} and got.samples["reference"] == [2e-3]
    assert db.get("library-form", "w1", "other") is None
    assert db.targets() == {"t0": {"cpu": "x"}}
    assert db.stats() == {"t0": {"library-form": 1}}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_nonsense_measurements_are_refused(tmp_path, bad):
    with pytest.raises(TuningDBError, match="seconds"):
        TuningDB(tmp_path / "t.sqlite").put(_record(1, seconds=bad))


_WRITER = """
import sys, time
from opweave.tune import Record, TuningDB
db = TuningDB(sys.argv[1])
me, n = int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    db.put(Record("library-form", f"w{me}-{i}", "t0", "w", {"form": "onednn"}, 1e-3,
                  {"onednn": [1e-3]}))
    if len(sys.argv) > 4 and i == 20:
        open(sys.argv[4], "w").close()   # a marker: 21 records are committed
"""


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "t.sqlite"
    TuningDB(path).stats()  # created once, as a compile would
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(me), "60"],
                              stderr=subprocess.PIPE, text=True) for me in range(4)]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()[-2000:]
    assert TuningDB(path).stats() == {"t0": {"library-form": 240}}
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_writer_killed_mid_write_leaves_a_usable_database(tmp_path):
    path, marker = tmp_path / "t.sqlite", tmp_path / "marker"
    victim = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), "0", "100000",
                               str(marker)])
    try:
        for _ in range(2400):  # wait for the event, however loaded the machine is
            if marker.exists() or victim.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists()
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    db = TuningDB(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningDBWarning)  # nothing to move aside
        count = db.stats()["t0"]["library-form"]
    assert count >= 21
    db.put(_record(1))
    assert db.get("library-form", "w1", "t0") is not None


@pytest.mark.parametrize("damage", ["garbage", "truncated", "schema"])
def test_a_damaged_database_is_moved_aside_and_rebuilt(tmp_path, damage):
    path = tmp_path / "t.sqlite"
    neighbour = tmp_path / "keep.txt"
    neighbour.write_text("untouched")
    db = TuningDB(path)
    for i in range(50):
        db.put(_record(i))
    with sqlite3.connect(path) as conn:  # everything into the main file, as at a clean exit
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    if damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
            conn.commit()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in ("-wal", "-shm"):
        if os.path.exists(str(path) + suffix):
            os.unlink(str(path) + suffix)
    fresh = TuningDB(path)
    with pytest.warns(TuningDBWarning, match="moved it to") as caught:
        assert fresh.stats() == {}
    message = str(caught[0].message)
    assert str(path) in message
    assert ("schema version 99" in message) == (damage == "schema"), message
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside and neighbour.read_text() == "untouched"
    fresh.put(_record(1))
    assert fresh.get("library-form", "w1", "t0") is not None


def test_a_row_that_does_not_parse_is_removed_with_a_warning(tmp_path):
    path = tmp_path / "t.sqlite"
    db = TuningDB(path)
    db.put(_record(1))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE records SET config='{not json'")
    with pytest.warns(TuningDBWarning, match="did not parse"):
        assert db.get("library-form", "w1", "t0") is None
    assert db.stats() == {}


def test_export_import_round_trip(tmp_path):
    source = TuningDB(tmp_path / "a.sqlite")
    for i in range(5):
        source.put(_record(i, target="tA"), {"cpu": "A"})
    assert source.export(tmp_path / "records.jsonl") == 5
    copy = TuningDB(tmp_path / "b.sqlite")
    assert copy.import_(tmp_path / "records.jsonl") == 5
    assert copy.records() == source.records() and copy.targets() == {"tA": {"cpu": "A"}}


def test_a_bad_export_line_is_refused_whole(tmp_path):
    lines = [json.dumps({"record": json.loads(json.dumps(_record(1).__dict__))}),
             json.dumps({"record": {**_record(2).__dict__, "seconds": "fast"}})]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    db = TuningDB(tmp_path / "t.sqlite")
    with pytest.raises(TuningDBError, match=r"records.jsonl:2: not a tuning record"):
        db.import_(path)
    assert db.stats() == {}


def test_records_of_another_machine_are_not_measurements_here(tmp_path):
    db = TuningDB(tmp_path / "t.sqlite")
    key = ("matmul", "shapes")
    wid, text = tune.workload("library-form", key)
    db.put(Record("library-form", wid, "another-machine", text, {"form": "reference"}, 1e-3,
                  {"reference": [1e-3]}))
    assert tune.recall("library-form", key, {"reference", "onednn"}, db) is None
    tune.remember("library-form", key, "onednn", {"onednn": [2e-3], "reference": [3e-3]}, db)
    assert tune.recall("library-form", key, {"reference", "onednn"}, db) == ("onednn", 2e-3)
    # a recorded form that is no longer a candidate is measured again
    assert tune.recall("library-form", key, {"reference"}, db) is None
    assert db.get("library-form", wid, target_id(describe())).samples["reference"] == [3e-3]


def test_a_record_of_an_older_revision_of_the_forms_is_measured_again(tmp_path):
    """library-form records made before its forms last changed (no "revision") are not
    recalled, and a new measurement replaces them (test_ranking: nor learned from)."""
    db = TuningDB(tmp_path / "t.sqlite")
    key = ("matmul", "shapes")
    wid, text = tune.workload("library-form", key)
    here = target_id(describe())
    db.put(Record("library-form", wid, here, text, {"form": "reference"}, 1e-3,
                  {"reference": [1e-3], "onednn": [6e-3]}))
    assert not tune.is_current(db.get("library-form", wid, here))
    assert tune.recall("library-form", key, {"reference", "onednn"}, db) is None
    tune.remember("library-form", key, "onednn", {"onednn": [1e-3], "reference": [2e-3]}, db)
    assert tune.is_current(db.get("library-form", wid, here))
    assert tune.recall("library-form", key, {"reference", "onednn"}, db) == ("onednn", 1e-3)


def test_a_revision_under_one_precision_leaves_the_others_records_current(tmp_path):
    """A revision of the bf16 library forms (under "bf16" only): a bf16 record of the
    revision before is measured again, a float32 one of revision 7 (float32's current
    one) is not."""
    current = tune.PRECISION_REVISIONS[("library-form", "bf16")]
    db = TuningDB(tmp_path / "t.sqlite")
    here = target_id(describe())
    for key in [("matmul", "shapes"), ("matmul", "shapes", ("precision", "bf16"))]:
        wid, text = tune.workload("library-form", key)
        revision = current - 1 if ("precision", "bf16") in key else 7
        db.put(Record("library-form", wid, here, text,
                      {"form": "onednn-direct", "revision": revision},
                      1e-3, {"onednn-direct": [1e-3]}))
    float32, bf16 = [("matmul", "shapes"), ("matmul", "shapes", ("precision", "bf16"))]
    assert tune.recall("library-form", float32, {"onednn-direct"}, db) == ("onednn-direct", 1e-3)
    assert tune.recall("library-form", bf16, {"onednn-direct"}, db) is None
    tune.remember("library-form", bf16, "onednn-direct-bf16", {"onednn-direct-bf16": [5e-4]}, db)
    assert tune.recall("library-form", bf16, {"onednn-direct-bf16"}, db) == \
        ("onednn-direct-bf16", 5e-4)
    assert tune.revision("library-form", tune.workload("library-form", bf16)[1]) == current > 7
    assert tune.revision("library-form", tune.workload("library-form", float32)[1]) == 7
