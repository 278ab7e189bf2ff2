"""The learned ranker in the tuning database: `opweave tune ranker` trains it
(cost/learned.py) on the database's records and stores it for this machine with the number
of forms worth measuring (`top_k`); a compile that must measure a library call's forms
then measures only the `top_k` the ranker puts first. Without a stored ranker every form is
measured, as before."""
from __future__ import annotations

import time

from ..notices import warn_once
from .db import Record, TuningDB, TuningDBWarning
from .target import describe, target_id

KIND = "cost-model"
WORKLOAD = "lightgbm-form-ranker"
_LOADED: dict[tuple[str, str, float], tuple[object, int] | None] = {}


def store(db: TuningDB, ranker_text: str, top_k: int, scores: dict, seconds: float) -> None:
    """Keep a trained ranker for this machine (replacing the last one)."""
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, not {top_k}")
    descriptor = describe()
    db.put(Record(KIND, WORKLOAD, target_id(descriptor),
                  "LightGBM ranking of library-form and gemm-form candidates",
                  {"lightgbm": ranker_text, "top_k": top_k, "scores": scores},
                  max(seconds, 1e-9), {}, time.time()), descriptor)


def load(db: TuningDB | None):
    """(ranker, top_k) stored for this machine, or None. A stored model that does not load
    is reported once and ignored: every form is then measured."""
    if db is None:
        return None
    record = db.get(KIND, WORKLOAD, target_id(describe()))
    if record is None:
        return None
    memo = (str(db.path), record.target, record.created)
    if memo not in _LOADED:
        _LOADED[memo] = _parse(db, record)
    return _LOADED[memo]


def _parse(db: TuningDB, record: Record):
    from ..cost.learned import Ranker

    try:
        top_k = int(record.config["top_k"])
        if top_k < 1:
            raise ValueError(f"top_k {top_k}")
        return Ranker.from_text(record.config["lightgbm"]), top_k
    except (KeyError, TypeError, ValueError, ImportError) as e:
        warn_once(f"opweave: the ranker stored in {db.path} does not load ({e}); every "
                  "candidate form is measured instead", TuningDBWarning)
        return None


def shortlist(kind: str, key, candidates: dict, db: TuningDB | None) -> dict:
    """The candidates worth measuring: the stored ranker's top k for this decision, in its
    order, or all of them when there is no ranker or it has no features for `key`."""
    from ..cost.learned import UnknownWorkload

    loaded = load(db)
    if loaded is None or len(candidates) <= 1:
        return candidates
    ranker, top_k = loaded
    try:
        order = ranker.order(kind, key, list(candidates), describe())
    except UnknownWorkload:
        return candidates
    return {name: candidates[name] for name in order[:top_k]}


# What measuring fewer forms may cost: the chosen forms' total time over the best forms'
# (held-out records), i.e. the latency a model made of these calls would lose.
MAX_SLOWDOWN = 1.02


def train(db: TuningDB, folds: int = 5, top_k: int | None = None,
          max_slowdown: float = MAX_SLOWDOWN) -> tuple[dict, int | None]:
    """Cross-validate a ranker on every record of `db` (all machines), then train it on
    all of them and store it for this machine with `top_k` (by default the smallest k whose
    held-out latency cost is within `max_slowdown`; none, and nothing stored, when no k is).
    Returns the held-out scores and the k stored."""
    from ..cost.learned import Ranker, cross_validate, examples

    start = time.perf_counter()
    from . import is_current

    batch = examples([r for r in db.records() if is_current(r)], db.targets())
    if len({e.group for e in batch}) < 2 * folds:
        raise ValueError(f"{db.path} holds {len({e.group for e in batch})} record(s) with two or "
                         f"more measured forms; {2 * folds} at least are needed to train and "
                         "score a ranker (compile or tune some models first)")
    scores = cross_validate(batch, folds)
    if top_k is None:
        top_k = next((k for k in (1, 2) if scores[f"latency_top{k}"] <= max_slowdown), None)
    if top_k is not None:
        store(db, Ranker.fit(batch).to_text(), top_k, scores, time.perf_counter() - start)
    return scores, top_k
