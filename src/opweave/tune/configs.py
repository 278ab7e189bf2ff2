"""Whole-graph configurations: the compiler's knobs for one graph, chosen by measuring the
whole model end to end (XTAT's joint tuning of passes) and remembered in the database.

A configuration sets the rewrite mode and the fusion policy together: which is best
depends on the model and the machine (greedy extraction can beat the ILP's estimate; on a
graph of tiny ops, fusion may cost more than it saves), and only a measurement of the
whole model says so. `opweave tune MODEL` searches the space (autotune/search.py) and records
the best configuration of each of the model's graphs, keyed by the graph's structure and
the target, as a "graph-config" record. `pipeline.compile_graph` looks it up first (unless
the caller set rewrite or fusion itself), so a tuned model compiles the same way every
time, measuring nothing.
"""
from __future__ import annotations

import hashlib
import itertools
from ..ir import Graph
from ..ir.text import format_attr
from .db import Record, TuningDB
from .target import describe, target_id

KIND = "graph-config"
# every knob and its values; the first value of each is the untuned default
SPACE: dict[str, tuple[str, ...]] = {
    "rewrite": ("eqsat", "greedy", "off"),
    "fusion": ("ilp", "greedy", "off"),
}
DEFAULT: dict[str, str] = {knob: values[0] for knob, values in SPACE.items()}


def all_configs() -> list[dict[str, str]]:
    return [dict(zip(SPACE, values)) for values in itertools.product(*SPACE.values())]


def check(config: dict) -> dict[str, str]:
    """`config` if it names every knob with one of its values (a record read back from a
    database may have been written by another version); ValueError otherwise."""
    if set(config) != set(SPACE) or any(config[k] not in SPACE[k] for k in SPACE):
        raise ValueError(f"not a graph configuration of this version: {config!r}")
    return dict(config)


def describe_config(config: dict) -> str:
    return " ".join(f"{k}={config[k]}" for k in SPACE)


def graph_key(graph: Graph) -> tuple[str, str]:
    """(hash, summary) of the graph's structure: its ops, attributes, types and wiring,
    with value names, the graph's name and source locations left out, so the same model
    gives the same key in any process, from any checkout."""
    names: dict = {}

    def name(v) -> str:
        return names.setdefault(v, f"v{len(names)}")

    lines = ["(" + ", ".join(f"{name(v)}: {v.type}" for v in graph.inputs) + ")"]
    for node in graph.nodes:
        attrs = {k: v for k, v in node.attrs.items() if not (node.op == "constant" and k == "name")}
        lines.append(", ".join(f"{name(v)}: {v.type}" for v in node.outputs) + f" = {node.op}("
                     + ", ".join(name(v) for v in node.inputs) + ") {"
                     + ", ".join(f"{k}={format_attr(v)}" for k, v in attrs.items()) + "}")
    lines.append("return " + ", ".join(name(v) for v in graph.outputs))
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
    ops = ", ".join(f"{op} {n}" for op, n in sorted(graph.op_counts().items()))
    inputs = ", ".join(str(v.type) for v in graph.inputs)
    return digest, f"graph ({inputs}) of {len(graph.nodes)} nodes: {ops}"


def recall(key: str, db: TuningDB | None) -> Record | None:
    """The recorded configuration of the graph with this `graph_key` on this machine."""
    if db is None:
        return None
    record = db.get(KIND, key, target_id(describe()))
    if record is None:
        return None
    try:
        check(record.config)
    except ValueError:
        return None
    return record


def remember(keys: list[tuple[str, str]], config: dict, seconds: float,
             samples: dict[str, list[float]], db: TuningDB, descriptor: dict | None = None) -> None:
    """Record `config` as the best for every graph in `keys` (one model's graphs), on the
    target that measured it (default: this process)."""
    descriptor = descriptor or describe()
    for digest, summary in keys:
        db.put(Record(KIND, digest, target_id(descriptor), summary, check(config), seconds,
                      samples), descriptor)
