"""Generate rewrite rules the way TASO does: enumerate every small graph over a few ops,
group the graphs by what they compute on random inputs (a fingerprint), and take pairs in
one group as candidate rules. A candidate must agree on a third, wider input set too
(verification by testing). Then thousands of values of every magnitude (inf, NaN and
subnormals included) either show a difference, or z3 proves the rule exact (prove.py).

Pruning, in TASO's spirit. Commutative ops take their operands in one order only; graphs
over constants alone are not built (folding handles them), nor graphs whose value is one
number everywhere (x - x, 0 * t: as rules they would put a constant of another shape in
place of a tensor, and they fail at inf and NaN). Only the first graph of a fingerprint
is used inside larger graphs (others would give rules that follow from a smaller one by
congruence), and each group pairs its first, smallest graph with every other member.
Rules that are instances of smaller ones (a common subgraph can become a fresh input)
or renamings of others (x <-> y) are dropped. Last, a rule is "covered" when equality
saturation with the existing rules puts both sides in one e-class; the rest are new.
"""
from __future__ import annotations

import math
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ir import Graph, TensorType, registry
from . import rule_proofs as prove
from ..passes.rewrite.rule import Builder, all_rules
from ..passes.rewrite.saturate import Limits, saturate
from ..passes.rewrite.term import ENode, Store, TermDag

SHAPE = (3, 4)
NAMES = ("x", "y", "z")
UNARY = ("neg", "relu", "exp")
BINARY = ("add", "sub", "mul", "maximum", "minimum")
COMMUTATIVE = frozenset({"add", "mul", "maximum", "minimum"})
CONSTANTS = (0.0, 1.0)
COVER_RULESETS = ["fold", "simplify", "layout", "algebra", "ac"]
COVER_CHUNK = 16  # candidates saturated together (one e-graph; shared subterms merge)
BUDGET = "not decidable here (time budget)"

# A term: ("input", k) | ("constant", value) | (op, child, ...), children being terms.
Term = tuple


@dataclass
class GenerationReport:
    graphs: int = 0          # graphs enumerated
    candidates: int = 0      # pairs with equal fingerprints
    verified: int = 0        # ... that also agree on a third input set
    redundant: int = 0       # ... that are instances of smaller rules (not examined further)
    proved_exact: int = 0    # of the rest: proved exact by z3
    inexact: int = 0         # ... with a counterexample (torch's or z3's): they hold
    #                          within rounding, or everywhere but at inf or NaN
    undecided: int = 0       # ... neither (uninterpreted ops, timeouts, the budget)
    new: int = 0             # of the rest: not derivable by the existing rules
    examples: list[str] = field(default_factory=list)  # a few new rules, as text
    # every rule examined: (text, "proved exact" | "inexact" | "undecided", covered by the
    # existing rules: True, False, or None when the time budget ran out first)
    rules: list[tuple[str, str, bool | None]] = field(default_factory=list)
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    cut_short: str = ""      # the stage the time budget stopped, if any

    def __str__(self) -> str:
        lines = [f"{self.graphs} graphs, {self.candidates} candidate pairs, {self.verified} "
                 f"verified, {self.redundant} redundant; of the rest {self.proved_exact} proved "
                 f"exact, {self.inexact} inexact, {self.undecided} undecided; {self.new} new; {self.seconds:.1f} s ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in self.stages.items()) + ")"
                 + (f" (time budget hit in {self.cut_short})" if self.cut_short else "")]
        return "\n".join(lines + [f"  {e}" for e in self.examples])


def render(term: Term) -> str:
    if term[0] == "input":
        return NAMES[term[1]]
    if term[0] == "constant":
        return f"{term[1]:g}"
    return f"{term[0]}({', '.join(render(c) for c in term[1:])})"


def size(term: Term) -> int:
    return 0 if term[0] in ("input", "constant") else 1 + sum(size(c) for c in term[1:])


def depth(term: Term) -> int:
    return 0 if term[0] in ("input", "constant") else 1 + max(depth(c) for c in term[1:])


def _nodes(term: Term) -> set[Term]:
    """The term and all its subterms, leaves included."""
    leaf = term[0] in ("input", "constant")
    return {term}.union(*(() if leaf else (_nodes(c) for c in term[1:])))


def _subterms(term: Term) -> set[Term]:
    return {t for t in _nodes(term) if t[0] not in ("input", "constant")}


def _replace(term: Term, old: Term, new: Term) -> Term:
    if term == old or term[0] in ("input", "constant"):
        return new if term == old else term
    return (term[0], *(_replace(c, old, new) for c in term[1:]))


def _renamed(pair: tuple[Term, Term]) -> tuple[Term, Term]:
    """The pair with its inputs numbered in order of appearance (x <-> y renamings)."""
    names: dict[int, int] = {}

    def walk(t: Term) -> Term:
        if t[0] == "input":
            return ("input", names.setdefault(t[1], len(names)))
        return t if t[0] == "constant" else (t[0], *(walk(c) for c in t[1:]))
    return walk(pair[0]), walk(pair[1])


class Values:
    """Terms evaluated (memoized) on fixed tensors for the inputs; constants are 0-d."""

    def __init__(self, inputs: list[torch.Tensor]):
        self.inputs, self._memo = inputs, {}

    def __call__(self, term: Term) -> torch.Tensor:
        v = self._memo.get(term)
        if v is None:
            if term[0] == "input":
                v = self.inputs[term[1]]
            elif term[0] == "constant":
                v = torch.tensor(term[1])
            else:
                v = registry.get(term[0]).impl(*(self(c) for c in term[1:]))
            self._memo[term] = v
        return v

    def close(self, a: Term, b: Term) -> bool:
        return torch.allclose(self(a), self(b), rtol=1e-4, atol=1e-5, equal_nan=True)

    def difference(self, a: Term, b: Term) -> str | None:
        """Where the two differ (not ==, not both NaN; -0 equals +0), preferring finite
        inputs and results (a rounding difference) to inf and NaN; None if nowhere."""
        x, y = self(a), self(b)
        differ = ~((x == y) | (x.isnan() & y.isnan()))
        if not differ.any():
            return None
        used = sorted({t[1] for t in _nodes(a) | _nodes(b) if t[0] == "input"})
        finite = differ & x.isfinite() & y.isfinite()
        for k in used:
            finite &= self.inputs[k].isfinite()
        i = (finite if finite.any() else differ).nonzero()[0, 0].item()
        kind = "within rounding" if finite.any() else "at inf/NaN"
        at = ", ".join(f"{NAMES[k]}={np.float32(self.inputs[k][i])!s}" for k in used)
        return f"{kind}, {at} gives {np.float32(x[i])!s} vs {np.float32(y[i])!s}"


def sample_inputs(seed: int, count: int) -> list[torch.Tensor]:
    """Per input, three sets of values of shape [3, 4], stacked: sets 0 and 1 make the
    fingerprint, set 2 (drawn wider) verifies."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1.0, 1.0, 3.0]).reshape(3, 1, 1)
    return [torch.randn((3, *SHAPE), generator=gen) * scales for _ in range(count)]


def stress_inputs(seed: int, count: int, n: int = 4096) -> list[torch.Tensor]:
    """Per input, `n` values of every magnitude: random bit patterns (all exponents,
    subnormals, inf, NaN), normals from 1e-4 to 1e4, and special values."""
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 2.0,
                            0.5, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 1e-45, -1e-45])
    out = []
    for _ in range(count):
        bits = torch.randint(-2**31, 2**31, (n,), generator=gen).to(torch.int32).view(torch.float32)
        wide = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 5, (n,), generator=gen)
        out.append(torch.cat([bits, wide, special[torch.randint(0, len(special), (n,), generator=gen)]]))
    return out


def fingerprint(values: torch.Tensor) -> bytes:
    """The values on the first two input sets, rounded to about 4 significant digits
    (-0 as +0; NaN and infinities kept apart)."""
    v = values[:2].double() + 0.0
    finite = v.isfinite()
    mantissa, exponent = torch.frexp(torch.where(finite, v, 0.0))
    special = torch.where(finite, 0.0, v.nan_to_num(nan=7.0))
    return torch.stack([torch.round(mantissa * 2**14), exponent.double(), special]).numpy().tobytes()


def enumerate_graphs(max_ops: int, max_depth: int, n_inputs: int, constants, values: Values,
                     deadline: float) -> tuple[dict[bytes, list[Term]], int, bool]:
    """Every graph up to `max_ops` ops and `max_depth` levels, grouped by fingerprint (each
    group's first graph is its smallest); the number of graphs; whether time ran out."""
    leaves = [("input", k) for k in range(n_inputs)] + [("constant", c) for c in constants]
    groups: dict[bytes, list[Term]] = {}
    for leaf in leaves[:n_inputs]:
        groups[fingerprint(values(leaf))] = [leaf]
    order = {t: i for i, t in enumerate(leaves)}  # operand order for commutative ops
    firsts: list[list[Term]] = [leaves]          # per size: graphs larger ones may use
    graphs = n_inputs
    for n in range(1, max_ops + 1):
        made = [(op, a) for op in UNARY for a in firsts[n - 1] if a[0] != "constant"]
        made += [(op, a, b) for op in BINARY for i in range(n) for a in firsts[i]
                 for b in firsts[n - 1 - i] if not a[0] == b[0] == "constant"
                 and not (op in COMMUTATIVE and order[a] > order[b])]
        firsts.append([])
        for term in made:
            if depth(term) > max_depth:
                continue
            if time.monotonic() > deadline:
                return groups, graphs, True
            graphs += 1
            v = values(term)
            if bool((v == v.reshape(-1)[0]).all()):
                continue  # one number everywhere: a constant in disguise
            group = groups.setdefault(fingerprint(v), [])
            group.append(term)
            if len(group) == 1:
                order[term] = len(order)
                firsts[n].append(term)
    return groups, graphs, False


def candidates(groups: dict[bytes, list[Term]]) -> list[tuple[Term, Term]]:
    """(a graph, the first graph of its group) for every other group member."""
    return [(t, first) for first, *rest in groups.values() for t in rest]


def redundant(a: Term, b: Term, values: Values, fresh: Term) -> bool:
    """Whether the rule is an instance of a smaller one: a subgraph common to both sides
    can become a fresh input and the sides still agree (TASO's common-subgraph pruning:
    relu(relu(exp(x))) == relu(exp(x)) is relu(relu(w)) == relu(w))."""
    return any(values.close(_replace(a, s, fresh), _replace(b, s, fresh))
               for s in _subterms(a) & _subterms(b))


class CandidateDag:
    """Every candidate's two sides as classes of one TermDag (shared subterms are one
    class), with a template graph for running them."""

    def __init__(self, n_inputs: int):
        self.dag = TermDag(Store())
        self.template = Graph("candidates")
        t = TensorType(SHAPE, torch.float32)
        for k in range(n_inputs):
            self.dag.inputs.append(self.dag.add(ENode("input", (("index", k),)), t))
            self.template.add_input(NAMES[k], t)
        self._builder = Builder(self.dag, self.dag, self.dag.store)
        self._classes: dict[Term, int] = {}

    def cls(self, term: Term) -> int:
        if term not in self._classes:
            if term[0] == "input":
                cid = self.dag.inputs[term[1]]
            elif term[0] == "constant":
                cid = self._builder.scalar(term[1], torch.float32)
            else:
                cid = self._builder.op(term[0], *(self.cls(c) for c in term[1:]))
            self._classes[term] = cid
        return self._classes[term]


def covered(cands: CandidateDag, pairs: list[tuple[Term, Term]], deadline: float,
            chunk: int = COVER_CHUNK) -> list[bool | None]:
    """Per pair, whether saturation with the existing rules proves it (None: no time).
    Without a deadline (inf), saturation is bounded by iterations alone: deterministic."""
    rules = all_rules(COVER_RULESETS)
    out: list[bool | None] = []
    for start in range(0, len(pairs), chunk):
        part = [(cands.cls(a), cands.cls(b)) for a, b in pairs[start:start + chunk]]
        if time.monotonic() > deadline:
            out += [None] * len(part)
            continue
        cands.dag.roots = [c for pair in part for c in pair]
        seconds = 1.0 if deadline != math.inf else math.inf
        snap = saturate(cands.dag, rules, Limits(iterations=6, seconds=seconds)).snapshot
        out += [snap.find(a) == snap.find(b) for a, b in part]
    return out


_CONTEXTS: list = []  # z3 contexts, kept for reuse: freeing one while terms in it live crashes z3


def prove_pairs(cands: CandidateDag, pairs: list[tuple[Term, Term]], deadline: float,
                budget: int, workers: int) -> list[str]:
    """prove.prove_dag on each pair, in `workers` threads (z3 runs outside the GIL; each
    thread works in a z3 context of its own); pairs past the deadline stay undecided."""
    classes = [(cands.cls(a), cands.cls(b)) for a, b in pairs]  # built here, read there
    workers = max(1, workers)
    while prove.z3 and len(_CONTEXTS) < workers:
        _CONTEXTS.append(prove.z3.Context())
    free: queue.SimpleQueue = queue.SimpleQueue()
    for ctx in _CONTEXTS[:workers] or [None] * workers:
        free.put(ctx)

    def one(lr: tuple[int, int]) -> str:
        if time.monotonic() > deadline:
            return BUDGET
        ctx = free.get()
        try:
            return prove.prove_dag(cands.dag, [lr[0]], [lr[1]], cands.template,
                                   budget, NAMES, probe_first=False, ctx=ctx)
        finally:
            free.put(ctx)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, classes))


def generate(max_ops: int = 3, seed: int = 0, time_budget: float | None = 30.0, *,
             max_depth: int = 2, n_inputs: int = 2, constants=CONSTANTS,
             prove_budget: int = prove.BUDGET // 8,
             workers: int = min(2, os.cpu_count() or 1), max_examples: int = 8) -> GenerationReport:
    """Enumerate graphs of up to `max_ops` ops and `max_depth` levels over `n_inputs`
    inputs of shape [3, 4] and 0-d `constants`, and report the candidate rules: how many
    hold on tests, are proved, and are new to the rule set. Each stage stops when
    `time_budget` seconds have passed (the report says which); with `time_budget=None`
    nothing depends on the clock and the report is the same on every machine.
    `prove_budget`: z3's work budget per candidate (see `prove.BUDGET`)."""
    start = time.monotonic()
    deadline = math.inf if time_budget is None else start + time_budget
    values = Values(sample_inputs(seed, n_inputs + 1))  # the last input: the fresh one
    groups, graphs, cut = enumerate_graphs(max_ops, max_depth, n_inputs, constants, values, deadline)
    report = GenerationReport(graphs=graphs, cut_short="enumeration" if cut else "")
    pairs = candidates(groups)
    verified = [(a, b) for a, b in pairs if values.close(a, b)]
    unique = {}
    for a, b in verified:
        if not redundant(a, b, values, ("input", n_inputs)):
            unique.setdefault(_renamed((a, b)), (a, b))
    kept = sorted(unique.values(), key=lambda p: (size(p[0]) + size(p[1]), render(p[0])))
    report.candidates, report.verified = len(pairs), len(verified)
    report.redundant = len(verified) - len(kept)
    report.stages["enumerate"] = time.monotonic() - start

    cands = CandidateDag(n_inputs)
    cover = covered(cands, kept, deadline)
    report.stages["saturate"] = time.monotonic() - start - report.stages["enumerate"]
    # a difference on thousands of values of every magnitude is a counterexample already
    stress = Values(stress_inputs(seed + 1, n_inputs))
    found = [stress.difference(a, b) for a, b in kept]
    proofs = iter(prove_pairs(cands, [p for p, f in zip(kept, found) if f is None], deadline,
                              prove_budget, workers))
    outcomes = [f"counterexample: {f}" if f else next(proofs) for f in found]
    report.stages["prove"] = time.monotonic() - start - sum(report.stages.values())
    report.proved_exact = sum(o == prove.PROVED for o in outcomes)
    report.inexact = sum(o.startswith("counterexample") for o in outcomes)
    report.undecided = len(outcomes) - report.proved_exact - report.inexact
    if None in cover or BUDGET in outcomes:
        report.cut_short = report.cut_short or ("coverage" if None in cover else "proving")
    report.rules = [(f"{render(a)} == {render(b)}", _status(o), c) for (a, b), o, c
                    in zip(kept, outcomes, cover)]
    new = [(pair, o) for pair, o, c in zip(kept, outcomes, cover) if c is False]
    report.new = len(new)
    shown: dict[str, list[str]] = {"proved exact": [], "inexact": [], "undecided": []}
    seen = set()  # one example per set of ops, smaller rules first
    for (a, b), outcome in new:
        status, ops = _status(outcome), frozenset(t[0] for t in _subterms(a) | _subterms(b))
        why = outcome.split(": ", 1)[1] if status == "inexact" else ""
        if (status, ops) not in seen:
            seen.add((status, ops))
            shown[status].append(f"{render(a)} == {render(b)}  [{status}{': ' + why if why else ''}]")
    quota = {"proved exact": max_examples // 2, "inexact": max_examples // 4}
    report.examples = [e for k, v in shown.items() for e in v[:quota.get(k, max_examples)]]
    report.examples = report.examples[:max_examples]
    report.seconds = time.monotonic() - start
    return report


def _status(outcome: str) -> str:
    if outcome == prove.PROVED:
        return "proved exact"
    return "inexact" if outcome.startswith("counterexample") else "undecided"
