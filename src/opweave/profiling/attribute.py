"""Mapping measured time up the levels, and each site against the roofline.

Levels, lowest first: site (a kernel, library call, op, eager op, or runtime between
steps) -> IR node -> frontend node (ATen/FX node, or ONNX node) -> source line ->
module path. A site that computes several IR nodes (a fused kernel, a GEMM with its
epilogue) splits its time over them by their share of the site's FLOPs; where the site
does no arithmetic, by their share of bytes moved; where neither is known, evenly. Every
higher level sums the IR nodes' shares, so each level's rows add up to the measured
total: runtime sites are rows of their own ("(runtime)"), never dropped.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..cost import Machine
from ..ir import provenance
from .record import Recording, Site

RUNTIME = "(runtime)"
UNKNOWN = "(no source line)"
NO_MODULE = "(no module recorded)"  # AOTAutograd's joint graphs keep source lines only


@dataclass
class Row:
    key: str
    seconds: float          # mean per call
    share: float            # of the total
    sites: int = 0          # how many sites contribute
    detail: str = ""


@dataclass
class Roof:
    """A site against the machine's roofline."""
    flops: float
    bytes: float
    seconds: float
    bound: str              # "compute", "memory", "overhead" or "" (not modelled)
    achieved: float         # the roofline's time over the measured time (0..1)

    @property
    def gflops(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def gbytes(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def node_cost(node) -> tuple[float, float]:
    try:
        cost = node.opdef.cost([v.type for v in node.inputs], [v.type for v in node.outputs],
                               node.attrs)
    except Exception:  # noqa: BLE001  (an op without a cost rule costs nothing here)
        return 0.0, 0.0
    return float(cost.flops), float(cost.bytes)


def shares(site: Site) -> list[tuple[object, float]]:
    """(IR node, fraction of the site's time) by the rule in the module docstring."""
    nodes = site.nodes
    if not nodes:
        return []
    costs = [node_cost(n) for n in nodes]
    for pick in (0, 1):
        total = sum(c[pick] for c in costs)
        if total > 0:
            return [(n, c[pick] / total) for n, c in zip(nodes, costs)]
    return [(n, 1 / len(nodes)) for n in nodes]


def site_roof(site: Site, seconds: float, machine: Machine) -> Roof:
    """FLOPs of the site's nodes, bytes of the values it reads and writes (the unfused
    nodes' traffic inside a fused kernel never reaches memory)."""
    if site.kind in ("runtime", "eager") or not site.nodes:
        return Roof(0.0, 0.0, seconds, "", 0.0)
    flops = sum(node_cost(n)[0] for n in site.nodes)
    nbytes = float(sum(v.type.nbytes for v in {*site.inputs, *site.outputs}))
    fits = machine.cache_bandwidth > 0 and nbytes <= machine.cache_bytes
    terms = {"compute": flops / machine.flops,
             "memory": nbytes / (machine.cache_bandwidth if fits else machine.bandwidth),
             "overhead": machine.launch}
    bound = max(terms, key=terms.get)
    achieved = min(1.0, terms[bound] / seconds) if seconds > 0 else 0.0
    return Roof(flops, nbytes, seconds, bound, achieved)


@dataclass
class Levels:
    total: float            # mean seconds per profiled call
    sites: list[Row]
    nodes: list[Row]
    frontend: list[Row]
    lines: list[Row]
    modules: list[Row]

    def all(self) -> dict[str, list[Row]]:
        return {"site": self.sites, "IR node": self.nodes, "frontend node": self.frontend,
                "source line": self.lines, "module": self.modules}


def levels(recording: Recording) -> Levels:
    total = recording.total_seconds
    by = {level: defaultdict(float) for level in ("site", "node", "frontend", "line", "module")}
    count = {level: defaultdict(set) for level in by}
    details: dict[tuple[str, str], str] = {}

    def add(level: str, key: str, seconds: float, site: Site, detail: str = "") -> None:
        by[level][key] += seconds
        count[level][key].add(site.index)
        if detail:
            details.setdefault((level, key), detail)

    for site in recording.sites:
        if site.ns == 0:
            continue
        seconds = recording.site_seconds(site)
        add("site", site.label, seconds, site, site.kind)
        if site.kind == "runtime":
            for level in ("node", "frontend", "line", "module"):
                add(level, RUNTIME, seconds, site)
            continue
        parts = shares(site) or [(None, 1.0)]
        for node, fraction in parts:
            part = seconds * fraction
            source = site.source if node is None else node.source
            where = provenance.parse(source)
            node_key = site.label if node is None else \
                f"{site.graph}:%{node.outputs[0].name} = {node.op}"
            add("node", node_key, part, site)
            add("frontend", where.node or UNKNOWN, part, site)
            line_key = f"{where.location} in {where.function}" if where.location else UNKNOWN
            add("line", line_key, part, site, where.file and f"{where.file}:{where.line}")
            add("module", where.module or NO_MODULE, part, site)

    def rows(level: str) -> list[Row]:
        out = [Row(k, v, v / total if total else 0.0, len(count[level][k]),
                   details.get((level, k), "")) for k, v in by[level].items()]
        return sorted(out, key=lambda r: -r.seconds)

    return Levels(total, rows("site"), rows("node"), rows("frontend"), rows("line"),
                  rows("module"))


def check_totals(result: Levels, rel: float = 1e-9) -> None:
    """AssertionError naming the first level whose rows do not add up to the total."""
    for name, rows in result.all().items():
        got = math.fsum(r.seconds for r in rows)
        if not math.isclose(got, result.total, rel_tol=rel, abs_tol=1e-12):
            raise AssertionError(f"the {name} level adds up to {got * 1e3:.6f} ms, the "
                                 f"measured total is {result.total * 1e3:.6f} ms")
