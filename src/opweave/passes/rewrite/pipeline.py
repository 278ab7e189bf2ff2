"""The rewrite pass: an IR graph in, an equal graph that the cost model prefers out, and a
report of what happened (rules that fired where, estimated cost, time spent).

Engines: `eqsat` (equality saturation in egglog, then ILP extraction with greedy
extraction as seed and fallback), `backtrack` (TASO's cost-bounded search, kept as the
comparator), `off`. `opweave.options.Options` carries these options (and reads
OPWEAVE_REWRITE); the pass itself reads no environment.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from ...cost import active, node_seconds
from ...ir import Graph, provenance, verify
from . import extract
from .rule import RULESETS, all_rules
from .saturate import Limits, saturate
from .term import ENode, Store, children_first, from_choice, from_graph, thaw, to_graph

ENGINES = ("eqsat", "backtrack", "off")
# "ac" (commutativity, associativity, distributivity) is opt-in: on the benchmark models
# it multiplies the e-graph (ViT: 1.5k -> 7k e-nodes) and never found a cheaper graph
# within the time budget.
# "ac" grows e-graphs fast; "merge-conv" measured 1-3% slower on ResNet-50 once fusion
# runs (a merged convolution's slices cannot take a ReLU post-op and are copied to
# channels-last), and neutral without fusion.
DEFAULT_RULESETS = tuple(name for name in RULESETS if name not in ("ac", "merge-conv"))
EXTRACTORS = ("ilp", "greedy")


@dataclass(frozen=True)
class RewriteOptions:
    engine: str = "eqsat"
    extractor: str = "ilp"
    rulesets: tuple[str, ...] = DEFAULT_RULESETS
    limits: Limits = Limits()
    ilp_seconds: float = 3.0
    backtrack_seconds: float = 8.0

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"unknown rewrite engine {self.engine!r}; choose from {ENGINES}")
        if self.extractor not in EXTRACTORS:
            raise ValueError(f"unknown extractor {self.extractor!r}; choose from {EXTRACTORS}")
        unknown = set(self.rulesets) - set(RULESETS)
        if unknown:
            raise ValueError(f"unknown rule sets {sorted(unknown)}; known: {list(RULESETS)}")

    @staticmethod
    def resolve(value: "RewriteOptions | str | bool | None") -> "RewriteOptions":
        """Options from what a user passed (`rewrite=` on compile): options, False, None
        (the default engine), or an engine name (greedy: eqsat with greedy extraction)."""
        if isinstance(value, RewriteOptions):
            return value
        if value is False:
            return RewriteOptions(engine="off")
        if value is None or value is True:
            return RewriteOptions()
        if value == "greedy":
            return RewriteOptions(extractor="greedy")
        return RewriteOptions(engine=value)

    def without_deadlines(self) -> "RewriteOptions":
        """Saturation bounded by iterations and e-nodes, extraction solved to the end,
        backtracking by its expansion count: the same graph on any machine."""
        return replace(self, limits=replace(self.limits, seconds=math.inf),
                       ilp_seconds=math.inf, backtrack_seconds=math.inf)


@dataclass
class RewriteReport:
    graph: str
    engine: str
    cost_before: float = 0.0      # estimated seconds
    cost_after: float = 0.0
    seconds: float = 0.0
    detail: str = ""              # e-graph size and stop reason, or the search's numbers
    extraction: str = ""
    fired: dict[str, list[str]] = field(default_factory=dict)  # rule -> where (one per use)
    nodes_before: int = 0
    nodes_after: int = 0

    def __str__(self) -> str:
        if self.engine == "off":
            return f"rewrite @{self.graph}: off"
        gain = self.cost_before / self.cost_after if self.cost_after else 1.0
        lines = [f"rewrite @{self.graph} ({self.engine}): estimated {self.cost_before * 1e3:.3f} ms -> "
                 f"{self.cost_after * 1e3:.3f} ms ({gain:.2f}x), {self.nodes_before} -> "
                 f"{self.nodes_after} nodes, {self.seconds:.2f} s",
                 f"  {self.detail}" + (f"; {self.extraction}" if self.extraction else "")]
        for name, places in sorted(self.fired.items(), key=lambda kv: -len(kv[1])):
            where = ", ".join(sorted(set(p for p in places if p)))[:160]
            lines.append(f"  {name} x{len(places)}" + (f"  at {where}" if where else ""))
        return "\n".join(lines)


def cost_function(store: Store):
    memo: dict[ENode, float] = {}

    def cost(cid: int, node: ENode) -> float:
        value = memo.get(node)
        if value is None:
            out = store.types[cid]
            outs = list(out) if isinstance(out, tuple) else [out]
            ins = [store.types[c] for c in node.children]
            value = memo[node] = node_seconds(node.op, ins, outs, thaw(node.attrs))
        return value
    return cost


def _fused_bias(op: str, operands: list[tuple[bool, bool]]) -> bool:
    """Whether `op` adds a constant vector to a product's result (`operands`: for each,
    whether it is a product's result and whether a constant vector). Fusion makes that add
    the product's bias, so it costs one launch: priced by the roofline, BERT-base's merged
    Q/K/V bias add over [128, 2304] streams through memory while two adds over its slices
    stay in cache, cheaper, and extraction kept those, which no product can fuse."""
    if op != "add" or len(operands) != 2:
        return False
    (a_product, a_vector), (b_product, b_vector) = operands
    return (a_product and b_vector) or (b_product and a_vector)


def with_fused_biases(cost, members: dict[int, list[ENode]], store: Store):
    """`cost` over the e-graph `members`, with fused biases (`_fused_bias`) at one launch."""
    products = {cid for cid, nodes in members.items() if any(n.op == "matmul" for n in nodes)}
    vectors = {cid for cid, nodes in members.items()
               if any(n.op == "constant" for n in nodes)
               and not isinstance(store.types[cid], tuple) and store.types[cid].rank == 1}

    def priced(cid: int, node: ENode) -> float:
        if _fused_bias(node.op, [(c in products, c in vectors) for c in node.children]):
            return active().launch
        return cost(cid, node)
    return priced


def graph_seconds(graph: Graph) -> float:
    """The estimated seconds of every node of `graph` as given (fused biases at one
    launch): repeated computations (two identical statistics) count twice, so the
    e-graph's sharing of them counts as the saving it is."""
    def kind(v) -> tuple[bool, bool]:
        p = v.producer
        return (p is not None and p.op == "matmul",
                p is not None and p.op == "constant" and v.type.rank == 1)
    return sum(active().launch if _fused_bias(n.op, [kind(v) for v in n.inputs]) else
               node_seconds(n.op, [v.type for v in n.inputs], [v.type for v in n.outputs],
                            dict(n.attrs))
               for n in graph.nodes)


def rewrite(graph: Graph, options: RewriteOptions = RewriteOptions()) -> tuple[Graph, RewriteReport]:
    report = RewriteReport(graph.name, options.engine, nodes_before=len(graph.nodes))
    if options.engine == "off":
        report.nodes_after = len(graph.nodes)
        return graph, report
    start = time.perf_counter()
    store = Store()
    dag = from_graph(graph, store)
    cost = cost_function(store)
    report.cost_before = graph_seconds(graph)
    rules = all_rules(options.rulesets)
    if options.engine == "eqsat":
        choice, roots = _eqsat(dag, rules, options, cost, report)
    else:
        from .backtrack import backtrack

        result = backtrack(dag, rules, cost, seconds=options.backtrack_seconds)
        choice, roots = result.dag.node_of, result.dag.roots
        report.detail = result.summary()
    report.cost_after = extract.dag_cost(
        choice, roots, with_fused_biases(cost, {c: [n] for c, n in choice.items()}, store))
    if report.cost_after >= report.cost_before:
        report.cost_after = report.cost_before
        report.nodes_after = len(graph.nodes)
        report.seconds = time.perf_counter() - start
        report.extraction += "; no cheaper graph, the original is kept"
        return graph, report
    new = to_graph(choice, roots, graph, store)
    new.remove_dead()
    verify(new)
    report.fired = _fired(choice, roots, store)
    report.nodes_after = len(new.nodes)
    report.seconds = time.perf_counter() - start
    return new, report


def _eqsat(dag, rules, options, base_cost, report):
    """Equality saturation in phases (see `RULESETS`), each followed by extraction."""
    levels = sorted({r.priority for r in rules})
    details, extractions = [], []
    share = Limits(**{**options.limits.__dict__,
                      "seconds": options.limits.seconds / max(len(levels), 1)})
    choice, roots = dag.node_of, dag.roots
    for level in levels:
        phase_rules = [r for r in rules if r.priority <= level]
        sat = saturate(dag, phase_rules, share)
        snap = sat.snapshot
        roots = [snap.find(r) for r in dag.roots]
        details.append(f"phase {level}: {snap.node_count} e-nodes / {len(snap.members)} classes, "
                       f"{sat.iterations} it, {sat.stop}, {sat.seconds:.2f} s")
        cost = with_fused_biases(base_cost, snap.members, dag.store)
        seed = extract.greedy(snap.members, roots, cost)
        chosen = seed
        if options.extractor == "ilp":
            try:
                chosen = extract.ilp(snap.members, roots, cost,
                                     time_limit=options.ilp_seconds / len(levels), seed=seed)
                if chosen.cost > seed.cost:  # a time limit can stop HiGHS above its seed
                    chosen = replace(seed, status=f"ILP {chosen.status}: greedy kept")
            except TimeoutError as err:
                chosen = replace(seed, status=f"ILP failed ({err}): greedy used")
        extractions.append(f"{chosen.method} {chosen.seconds:.2f} s"
                           + (f" ({chosen.status})" if chosen.status else "")
                           + f", {chosen.cost * 1e3:.3f} ms vs greedy {seed.cost * 1e3:.3f} ms")
        given = with_fused_biases(base_cost, {c: [n] for c, n in dag.node_of.items()},
                                  dag.store)
        if chosen.cost >= extract.dag_cost(dag.node_of, dag.roots, given):
            extractions[-1] += ", phase input kept"  # the phase found nothing cheaper
            continue
        choice = chosen.choice
        dag = from_choice(dag.store, choice, roots, [snap.find(i) for i in dag.inputs])
    choice, roots = dag.node_of, dag.roots
    report.detail = "; ".join(details)
    report.extraction = "extraction: " + "; ".join(extractions)
    return choice, roots


def _fired(choice: dict[int, ENode], roots: list[int], store: Store) -> dict[str, list[str]]:
    """Rules whose e-nodes are in the chosen graph, with the source of each use."""
    fired: dict[str, list[str]] = defaultdict(list)
    for cid in children_first(choice, roots):
        rule = store.created_by.get(choice[cid])
        if rule:
            fired[rule].append(_short(store.sources.get(cid, "")))
    return dict(fired)


def _short(source: str) -> str:
    """A node's source as `file:N`, or its frontend node where no line is known."""
    where = provenance.parse(source)
    return where.location.rsplit("/", 1)[-1] or where.node


__all__ = ["RewriteOptions", "RewriteReport", "rewrite"]
