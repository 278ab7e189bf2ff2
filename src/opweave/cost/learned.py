"""A learned cost model: gradient-boosted trees (LightGBM) trained on the tuning
database's measurements rank the candidate forms of a library call (oneDNN, oneDNN as a
GEMM, the reference ATen call; torch's or oneDNN's GEMM), so that a compile which must
measure measures only the forms ranked first.

Every database record holds the samples of every candidate it measured, so one record
gives one example per candidate. The features come from the decision's key (op, shapes,
attributes, epilogue) and the record's target (threads, cores, ISA), never from the
workload's identity, so the model ranks shapes it never saw; records of other machines
may rank candidates (they are never taken as measurements here). The label is a form's
time relative to the record's fastest, in log2: the model learns which form wins, not
how long a workload takes. The model is stored as LightGBM's own text format (no pickle).
"""
from __future__ import annotations

import ast
import math
import re
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

KINDS = ("library-form", "gemm-form")  # the decisions this model ranks
# every candidate those measure
FORMS = ("reference", "onednn", "onednn-gemm", "torch", "onednn-direct", "cpp-gemv",
         "onednn-winograd")
# the feature holding a form's index in FORMS, named for this list: a model trained on
# another list reads indices that mean other forms, so it is refused (`Ranker.from_text`)
# and every form is measured until `opweave tune ranker` trains one again
FORM = "form_of_7"

_OPS = ("matmul", "conv")
_BINARY = frozenset({"add", "sub", "mul", "div", "maximum", "minimum"})
FEATURES = ("kind", "op", FORM, "log_rows", "log_k", "log_n", "log_flops", "log_bytes",
            "window", "stride", "groups", "epilogue_ops", "epilogue_binary", "a_transposed",
            "b_transposed", "threads", "cores", "avx512")
CATEGORICAL = ("kind", "op", FORM)
_SHAPE = re.compile(r"\[([0-9, ]*)\]")


class UnknownWorkload(ValueError):
    """A key this model has no features for (another kind of decision)."""


@dataclass(frozen=True)
class Example:
    group: str                 # the record: (kind, workload, target)
    workload: str              # folds split by workload, so a test shape is never trained on
    form: str
    features: tuple[float, ...]
    seconds: float             # the form's best sample


def _shape(type_text: str) -> tuple[int, ...]:
    m = _SHAPE.search(type_text)
    if m is None:
        raise UnknownWorkload(f"no shape in {type_text!r}")
    return tuple(int(d) for d in m.group(1).replace(" ", "").split(",") if d)


def _prod(xs: Iterable[int]) -> int:
    return math.prod(xs) if xs else 1


def _log(x: float) -> float:
    return math.log2(max(float(x), 1.0))


def _attr(attrs: dict, name: str, default):
    text = attrs.get(name)
    return default if text is None else ast.literal_eval(text)


def _library_geometry(key) -> dict:
    """GEMM-equivalent sizes of a library-form key: (op, attrs, input types, epilogue).
    A key of another precision holds ("precision", ...) and more after the epilogue: the
    features describe float32 work only, so such decisions are not ranked (every form is
    measured)."""
    if len(key) != 4:
        raise UnknownWorkload(f"a library decision keyed {key[4:]} has no features")
    op, attr_items, types, posts = key
    attrs = dict(attr_items)
    shapes = [_shape(t) for t in types]
    geometry = {"op": _OPS.index(op) if op in _OPS else len(_OPS), "window": 1, "stride": 1,
                "groups": 1, "a_transposed": 0, "b_transposed": 0,
                "epilogue_ops": len(posts), "epilogue_binary": sum(p[0] in _BINARY for p in posts)}
    if op == "conv" and len(shapes) >= 2 and len(shapes[0]) == 4 and len(shapes[1]) == 4:
        (n, c, h, w), (o, _, kh, kw) = shapes[0], shapes[1]
        stride, padding, dilation = (_attr(attrs, k, d) for k, d in
                                     (("stride", [1, 1]), ("padding", [0, 0]), ("dilation", [1, 1])))
        stride, padding, dilation = ([v, v] if isinstance(v, int) else list(v)
                                     for v in (stride, padding, dilation))
        groups = int(_attr(attrs, "groups", 1))
        ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        geometry.update(rows=n * max(ho, 0) * max(wo, 0), k=c // max(groups, 1) * kh * kw, n=o,
                        window=kh * kw, stride=stride[0], groups=groups,
                        bytes=4 * (n * c * h * w + _prod(shapes[1]) + n * o * max(ho, 0) * max(wo, 0)))
    elif op == "matmul" and len(shapes) >= 2 and shapes[0] and shapes[1]:
        a, b = shapes[0], shapes[1]
        geometry.update(rows=_prod(a[:-1]), k=a[-1], n=b[-1] if len(b) > 1 else 1,
                        bytes=4 * (_prod(a) + _prod(b) + _prod(a[:-1]) * (b[-1] if len(b) > 1 else 1)))
    else:
        raise UnknownWorkload(f"a {op} with inputs {types} has no GEMM geometry")
    return geometry


def _gemm_geometry(key) -> dict:
    """A gemm-form key: (a shape, a strides, b shape, b strides, dtype, threads)."""
    (m, k), a_strides, (_, n), b_strides = key[0], key[1], key[2], key[3]
    return {"op": _OPS.index("matmul"), "rows": m, "k": k, "n": n, "window": 1, "stride": 1,
            "groups": 1, "epilogue_ops": 0, "epilogue_binary": 0,
            "a_transposed": int(a_strides[-1] != 1), "b_transposed": int(b_strides[-1] != 1),
            "bytes": 4 * (m * k + k * n + m * n), "threads": key[5]}


def features(kind: str, key, form: str, target: dict) -> tuple[float, ...]:
    """The feature vector of running `form` for the decision `key` on `target` (a
    `tune.target.describe()` dict)."""
    if kind == "library-form":
        g = _library_geometry(key)
    elif kind == "gemm-form":
        g = _gemm_geometry(key)
    else:
        raise UnknownWorkload(f"no features for {kind} decisions")
    flops = 2 * g["rows"] * g["k"] * g["n"]
    values = {
        "kind": KINDS.index(kind), "op": g["op"],
        FORM: FORMS.index(form) if form in FORMS else len(FORMS),
        "log_rows": _log(g["rows"]), "log_k": _log(g["k"]), "log_n": _log(g["n"]),
        "log_flops": _log(flops), "log_bytes": _log(g["bytes"]),
        "threads": g.get("threads", target.get("threads", 1)),
        "cores": target.get("cores") or 1,
        "avx512": int("avx512f" in target.get("features", ())),
    }
    values.update({k: g[k] for k in ("window", "stride", "groups", "epilogue_ops",
                                     "epilogue_binary", "a_transposed", "b_transposed")})
    return tuple(float(values[name]) for name in FEATURES)


def parse_key(workload_text: str):
    """The key a record was made from (its workload text is `kind:repr(key)`)."""
    _, _, text = workload_text.partition(":")
    return ast.literal_eval(text)


def examples(records, targets: dict[str, dict]) -> list[Example]:
    """One example per measured candidate of every record this model can read; `targets`
    maps each record's target id to its descriptor (`TuningDB.targets()`)."""
    out = []
    for r in records:
        if r.kind not in KINDS or r.target not in targets:
            continue
        try:
            key = parse_key(r.workload_text)
            rows = [(form, features(r.kind, key, form, targets[r.target]), min(times))
                    for form, times in r.samples.items() if times]
        except (UnknownWorkload, ValueError, SyntaxError, TypeError, IndexError, KeyError):
            continue  # a decision of a shape this model has no features for
        if len(rows) < 2:
            continue
        group = f"{r.kind}/{r.workload}/{r.target}"
        out.extend(Example(group, r.workload, form, f, max(s, 1e-9)) for form, f, s in rows)
    return out


def _fastest(batch: Sequence[Example]) -> dict[str, float]:
    """Each group's (record's) fastest time."""
    best: dict[str, float] = {}
    for e in batch:
        best[e.group] = min(best.get(e.group, math.inf), e.seconds)
    return best


def _labels(batch: Sequence[Example]) -> list[float]:
    """Each example's time over its group's fastest, in log2 (0 for the winner)."""
    best = _fastest(batch)
    return [math.log2(e.seconds / best[e.group]) for e in batch]


def _weights(batch: Sequence[Example]) -> list[float]:
    """Each example weighs the square root of its record's best time (in microseconds): a
    wrong pick costs in proportion to the call's time, so long calls must be ranked right,
    but without letting a few GEMMs drown the rest. (Held out on this machine's records:
    weighting by the square root cut the total time lost by measuring only the top form
    from 13.3% to 3.1%; weighting by the time itself did no better and ranked worse.)"""
    best = _fastest(batch)
    return [math.sqrt(best[e.group] / 1e-6) for e in batch]


PARAMS = {"objective": "regression", "learning_rate": 0.05, "num_leaves": 15,
          "min_data_in_leaf": 5, "deterministic": True, "force_row_wise": True,
          "num_threads": 1, "seed": 0, "verbose": -1}
ROUNDS = 150


class Ranker:
    """A trained model: `order(kind, key, forms, target)` puts the forms expected fastest
    first."""

    def __init__(self, booster):
        self.booster = booster

    @classmethod
    def fit(cls, batch: Sequence[Example]) -> "Ranker":
        import lightgbm
        import numpy as np

        if not batch:
            raise ValueError("no examples to train on")
        data = lightgbm.Dataset(np.array([e.features for e in batch], dtype=np.float64),
                                label=np.array(_labels(batch)), weight=np.array(_weights(batch)),
                                feature_name=list(FEATURES), categorical_feature=list(CATEGORICAL))
        return cls(lightgbm.train(PARAMS, data, num_boost_round=ROUNDS))

    @classmethod
    def from_text(cls, text: str) -> "Ranker":
        """A model saved by `to_text`; ValueError when the text is not one."""
        import lightgbm

        try:
            booster = lightgbm.Booster(model_str=text)
        except lightgbm.basic.LightGBMError as e:
            raise ValueError(f"not a LightGBM model: {e}") from None
        if booster.feature_name() != list(FEATURES):
            raise ValueError(f"a model of other features ({booster.feature_name()})")
        return cls(booster)

    def to_text(self) -> str:
        return self.booster.model_to_string()

    def predict(self, rows: Sequence[Sequence[float]]) -> list[float]:
        import numpy as np

        return [float(v) for v in self.booster.predict(np.array(rows, dtype=np.float64))]

    def order(self, kind: str, key, forms: Sequence[str], target: dict) -> list[str]:
        scores = self.predict([features(kind, key, f, target) for f in forms])
        return [f for _, _, f in sorted(zip(scores, range(len(forms)), forms))]


# -- how good the ranking is, on records it was not trained on ----------------------------

def _fold(workload: str, folds: int) -> int:
    return zlib.crc32(workload.encode()) % folds  # a stable split, whatever the id looks like


def cross_validate(batch: Sequence[Example], folds: int = 5) -> dict:
    """Rankings predicted for held-out workloads (k-fold over workloads), scored against
    what was measured: top-1 and top-2 hit rates, the mean Kendall tau per record, the
    slowdown of measuring only the top k (geometric mean of the chosen form's time over
    the best, and the total time of the chosen forms over that of the best ones: what a
    model made of these calls would lose), and the share of measuring time each k saves.
    A baseline that always picks the form most often fastest in training (per kind and
    op) is scored too."""
    from scipy.stats import kendalltau

    groups: dict[str, list[Example]] = {}
    for e in batch:
        groups.setdefault(e.group, []).append(e)
    predicted: dict[str, list[float]] = {}
    baseline: dict[str, str] = {}
    for fold in range(folds):
        train = [e for e in batch if _fold(e.workload, folds) != fold]
        test = [g for g, es in groups.items() if _fold(es[0].workload, folds) == fold]
        if not train or not test:
            continue
        ranker = Ranker.fit(train)
        favourite = _favourites(train)
        for g in test:
            es = groups[g]
            predicted[g] = ranker.predict([e.features for e in es])
            baseline[g] = favourite.get(es[0].features[:2], es[0].form)
    scores = {"records": len(predicted), "examples": sum(len(groups[g]) for g in predicted)}
    top1 = top2 = base_hits = 0
    taus, slow, base_slow = [], {1: [], 2: []}, []
    spent, chosen = {1: 0.0, 2: 0.0}, {1: 0.0, 2: 0.0}
    total = fastest = base_chosen = 0.0
    for g, p in predicted.items():
        es = groups[g]
        times = [e.seconds for e in es]
        order = sorted(range(len(es)), key=lambda i: (p[i], i))
        best = min(range(len(es)), key=lambda i: times[i])
        top1 += order[0] == best
        top2 += best in order[:2]
        tau = kendalltau(p, times).statistic
        if not math.isnan(tau):
            taus.append(tau)
        for k in slow:
            slow[k].append(min(times[i] for i in order[:k]) / times[best])
            spent[k] += sum(times[i] for i in order[:k])
            chosen[k] += min(times[i] for i in order[:k])
        total += sum(times)
        fastest += times[best]
        base = next(i for i, e in enumerate(es) if e.form == baseline[g]) \
            if any(e.form == baseline[g] for e in es) else order[0]
        base_hits += base == best
        base_slow.append(times[base] / times[best])
        base_chosen += times[base]
    n = max(len(predicted), 1)
    scores.update({
        "top1": top1 / n, "top2": top2 / n,
        "kendall_tau": sum(taus) / len(taus) if taus else math.nan,
        "slowdown_top1": _geomean(slow[1]), "slowdown_top2": _geomean(slow[2]),
        "latency_top1": chosen[1] / fastest, "latency_top2": chosen[2] / fastest,
        "time_saved_top1": 1 - spent[1] / total if total else 0.0,
        "time_saved_top2": 1 - spent[2] / total if total else 0.0,
        "baseline_top1": base_hits / n, "baseline_slowdown": _geomean(base_slow),
        "baseline_latency": base_chosen / fastest if fastest else math.nan,
    })
    return scores


def _favourites(batch: Sequence[Example]) -> dict[tuple, str]:
    """The form most often fastest per (kind, op) in `batch`."""
    wins: dict[tuple, dict[str, int]] = {}
    best: dict[str, Example] = {}
    for e in batch:
        if e.group not in best or e.seconds < best[e.group].seconds:
            best[e.group] = e
    for e in best.values():
        counts = wins.setdefault(e.features[:2], {})
        counts[e.form] = counts.get(e.form, 0) + 1
    return {k: max(sorted(v), key=v.get) for k, v in wins.items()}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan
