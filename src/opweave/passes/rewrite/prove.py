"""Prove rules with z3 where a solver can decide them, instead of trusting random tests.

Elementwise rules: both sides of each example become z3 IEEE float32 expressions (round to
nearest, ties to even) over one symbolic element per graph input. One element suffices:
every op is one-to-one under broadcasting, so each output element is the same function
of one element of each input, and every input value can occur. Constants with several
elements are proved once per distinct combination of their elements. z3 then asks
whether the sides can differ. Equal means both NaN, or `fpEQ` (so -0 == +0 counts as
equal: no rule here may be refused for flipping the sign of a zero).

Outcomes: "proved exact", "counterexample: <values>" (the rule holds within rounding at
best; the values are replayed through torch), or "not decidable here (<reason>)". Ops
z3 does not model exactly (exp, tanh, pow, ...) are uninterpreted functions: a proof
still holds (it holds for every function), but a counterexample must be replayed.

Index rules (slice-slice, permute-permute) are proved on their composition formulas over
symbolic integers, and the rules are checked to compute those formulas.
"""
from __future__ import annotations

import dataclasses
import itertools
import struct
import time

import numpy as np
import torch

from ...ir import Graph
from .rule import Example, Reject, Rule, all_rules
from .soundness import example_dag, rewrite_example, run
from .term import TermDag, thaw

try:
    import z3
except ImportError:  # pragma: no cover - z3-solver is an optional dependency
    z3 = None

PROVED = "proved exact"
TIMEOUT_MS = 2000
MAX_CONSTANT_TUPLES = 16
_OPAQUE = {"exp", "log", "log1p", "rsqrt", "sigmoid", "tanh", "erf", "gelu", "sin", "cos", "pow"}


class Undecidable(Exception):
    """The graph is outside what the encoding models."""


def _fp(value: float):
    return z3.FPVal(float(np.float32(value)), z3.Float32())


def _float(model, expr) -> float:
    bits = model.eval(z3.fpToIEEEBV(expr), model_completion=True).as_long()
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class Encoder:
    """z3 terms for the classes of one dag, with constants taken from `values`."""

    def __init__(self, dag: TermDag, values: dict[str, float], names=None):
        self.dag, self.values, self.names = dag, values, names
        self.inputs: dict[int, object] = {}      # input index -> FP variable
        self.opaque: set[str] = set()            # ops encoded as uninterpreted functions
        self.signed_zero = False                 # a max/min chose between -0 and +0
        self._functions: dict = {}
        self._memo: dict[int, object] = {}

    def term(self, cid: int):
        if cid not in self._memo:
            node = self.dag.node_of[cid]
            self._memo[cid] = self._node(node, [self.term(c) for c in node.children])
        return self._memo[cid]

    def _node(self, node, a):
        op, rm = node.op, z3.RNE()
        if op == "input":
            k = node.attr("index")
            name = self.names[k] if self.names else f"in{k}"
            return self.inputs.setdefault(k, z3.FP(name, z3.Float32()))
        if op == "constant":
            return _fp(self.values[node.attr("name")])
        if op == "div" and node.attrs_get("rounding", "none") != "none":
            raise Undecidable(f"div rounding={node.attr('rounding')}")
        binary = {"add": z3.fpAdd, "sub": z3.fpSub, "mul": z3.fpMul, "div": z3.fpDiv}
        if op in binary:
            return binary[op](rm, a[0], a[1])
        if op == "neg":
            return z3.fpNeg(a[0])
        if op == "abs":
            return z3.fpAbs(a[0])
        if op == "sqrt":
            return z3.fpSqrt(rm, a[0])
        if op == "reciprocal":
            return z3.fpDiv(rm, _fp(1.0), a[0])
        if op == "relu":  # clamp_min(x, 0): NaN and -0 pass through
            return z3.If(z3.fpLT(a[0], _fp(0.0)), _fp(0.0), a[0])
        if op in ("maximum", "minimum"):
            return self._extremum(op == "maximum", a[0], a[1])
        if op == "clamp":
            x = a[0]
            if node.attr("min") is not None:
                x = z3.If(z3.fpLT(x, _fp(node.attr("min"))), _fp(node.attr("min")), x)
            if node.attr("max") is not None:
                x = z3.If(z3.fpGT(x, _fp(node.attr("max"))), _fp(node.attr("max")), x)
            return x
        if op == "cast":  # float32 to float32 (types are checked): the identity
            return a[0]
        if op in _OPAQUE:
            self.opaque.add(op)
            key = (op, node.attrs, len(a))
            if key not in self._functions:
                sorts = [z3.Float32()] * (len(a) + 1)
                self._functions[key] = z3.Function(f"{op}{len(self._functions)}", *sorts)
            return self._functions[key](*a)
        raise Undecidable(f"{op} is not an elementwise op z3 models")

    def _extremum(self, is_max: bool, x, y):
        """torch.maximum/minimum: NaN propagates; between -0 and +0 torch's vector and scalar
        paths disagree, so the sign of that zero is left free."""
        choice = z3.FreshBool("zero_sign")
        self.signed_zero = True
        better = z3.fpGT(x, y) if is_max else z3.fpLT(x, y)
        worse = z3.fpLT(x, y) if is_max else z3.fpGT(x, y)
        pick = z3.If(better, x, z3.If(worse, y, z3.If(choice, x, y)))
        return z3.If(z3.Or(z3.fpIsNaN(x), z3.fpIsNaN(y)), z3.fpNaN(z3.Float32()), pick)


def _cone(dag: TermDag, roots: list[int]) -> list[int]:
    classes = dag.reachable(roots)
    for cid in classes:
        t = dag.type(cid)
        if isinstance(t, tuple):
            raise Undecidable(f"{dag.node_of[cid].op} has several outputs")
        if t.dtype != torch.float32:
            raise Undecidable(f"{dag.node_of[cid].op} computes {t.dtype}, not float32")
    return classes


def _constant_tuples(dag: TermDag, classes: list[int]) -> list[dict[str, float]]:
    """Each distinct combination of constant elements that one output element can see."""
    names = sorted({dag.node_of[c].attr("name") for c in classes if dag.node_of[c].op == "constant"})
    if not names:
        return [{}]
    tensors = torch.broadcast_tensors(*(dag.store.constants[n] for n in names))
    rows = torch.unique(torch.stack([t.reshape(-1) for t in tensors], 1), dim=0)
    if len(rows) > MAX_CONSTANT_TUPLES:
        raise Undecidable(f"{len(rows)} combinations of constant elements")
    return [dict(zip(names, row.tolist())) for row in rows]


def _differ(a, b):
    return z3.Not(z3.Or(z3.And(z3.fpIsNaN(a), z3.fpIsNaN(b)), z3.fpEQ(a, b)))


def replay(dag: TermDag, lhs: list[int], rhs: list[int], template: Graph,
           values: dict[int, float]) -> tuple[float, float] | None:
    """Run both sides in torch with every input filled with its counterexample value: the
    first (lhs, rhs) pair of elements that differ, or None when none do."""
    inputs = [torch.full(v.type.shape, values.get(k, 1.0), dtype=v.type.dtype)
              for k, v in enumerate(template.inputs)]
    for a, b in zip(run(dag, lhs, template, inputs), run(dag, rhs, template, inputs)):
        a, b = torch.broadcast_tensors(a, b)
        differ = ~((a == b) | (a.isnan() & b.isnan()))
        if differ.any():
            i = differ.reshape(-1).nonzero()[0, 0]
            return a.reshape(-1)[i].item(), b.reshape(-1)[i].item()
    return None


def prove_dag(dag: TermDag, lhs: list[int], rhs: list[int], template: Graph | None = None,
              timeout_ms: int = TIMEOUT_MS, names=None) -> str:
    """Whether classes `lhs` and `rhs` of `dag` are equal for every float32 input.
    With a `template` (the graph inputs), counterexamples are replayed through torch."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    deadline = time.monotonic() + timeout_ms / 1000
    try:
        tuples = _constant_tuples(dag, _cone(dag, lhs + rhs))
        for values in tuples:
            enc = Encoder(dag, values, names)
            pairs = [(enc.term(a), enc.term(b)) for a, b in zip(lhs, rhs)]
            solver = z3.Solver()
            solver.set("timeout", max(1, int((deadline - time.monotonic()) * 1000)))
            solver.add(z3.Or([_differ(a, b) for a, b in pairs]))
            result = solver.check()
            if result == z3.unknown:
                raise Undecidable(f"z3: {solver.reason_unknown()}")
            if result == z3.sat:
                return _counterexample(dag, lhs, rhs, template, enc, solver.model(), pairs)
    except Undecidable as err:
        return f"not decidable here ({err})"
    return PROVED


def _counterexample(dag, lhs, rhs, template, enc: Encoder, model, pairs) -> str:
    values = {k: _float(model, v) for k, v in sorted(enc.inputs.items())}
    shown = ", ".join(f"{v}={np.float32(values[k])}" for k, v in sorted(enc.inputs.items()))
    found = replay(dag, lhs, rhs, template, values) if template is not None else None
    if found is None:
        a, b = (_float(model, e) for e in next((a, b) for a, b in pairs if not
                                               model.eval(z3.Not(_differ(a, b)), True)))
        if template is not None and (enc.opaque or enc.signed_zero):
            why = ", ".join(sorted(enc.opaque)) or "the sign of a zero from max/min"
            raise Undecidable(f"{why} not modeled exactly; z3's counterexample {shown} "
                              "does not reproduce in torch")
        suffix = "" if template is None else " (torch does not reproduce it)"
    else:
        (a, b), suffix = found, ""
    return f"counterexample: {shown or 'any input'} gives {np.float32(a)} vs {np.float32(b)}{suffix}"


def prove_rule(rule: Rule, timeout_ms: int = TIMEOUT_MS) -> str:
    """Prove `rule` on each of its examples (index rules: on their formulas)."""
    if rule.name in _INDEX_PROOFS:
        return _INDEX_PROOFS[rule.name]()
    deadline = time.monotonic() + timeout_ms / 1000
    for i in range(len(rule.examples)):
        try:
            dag, roots, template = example_dag(rule, i)
            new_roots = rewrite_example(rule, dag, roots)
        except Reject as err:
            return f"not decidable here (example {i} does not rewrite: {err})"
        left = max(1, int((deadline - time.monotonic()) * 1000))
        outcome = prove_dag(dag, roots, new_roots, template, left)
        if outcome != PROVED:
            return outcome + (f" [example {i}]" if len(rule.examples) > 1 else "")
    return PROVED


def prove_all(rules: list[Rule] | None = None, timeout_ms: int = TIMEOUT_MS) -> dict[str, str]:
    """Rule name -> outcome, for `rules` (default: every registered rule)."""
    return {r.name: prove_rule(r, timeout_ms) for r in (all_rules() if rules is None else rules)}


# -- index rules ----------------------------------------------------------------------------

def _valid(claim, *assumptions, timeout_ms: int = TIMEOUT_MS) -> bool:
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    solver.add(*assumptions, z3.Not(claim))
    return solver.check() == z3.unsat


def prove_slice_slice() -> str:
    """Slicing [s1::t1] then [s2::t2] is slicing [s1 + t1 s2 :: t1 t2] (starts normalized to
    be >= 0, which Python's range does), and ending at last + 1 keeps exactly n elements.
    Then the rule is run on a grid of slices, negative and overlong bounds included."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    s1, t1, s2, t2, k, n = z3.Ints("s1 t1 s2 t2 k n")
    ranges = [s1 >= 0, t1 >= 1, s2 >= 0, t2 >= 1, k >= 0, n >= 1]
    start, step = s1 + t1 * s2, t1 * t2
    if not _valid(s1 + t1 * (s2 + t2 * k) == start + step * k, *ranges):
        return "counterexample: element k of the composed slice"
    end = start + step * (n - 1) + 1  # the rule's end: the last element + 1
    if not _valid((end - start + step - 1) / step == n, *ranges):  # len(range(start, end, step))
        return "counterexample: the composed slice's length"
    grid = [(s, e, t) for s in (-8, -3, 0, 2) for e in (-1, 4, 100) for t in (1, 3)]
    for (a, b, c), (d, e, f) in itertools.product(grid, grid):
        want = list(range(7))[a:b:c][d:e:f]
        got = _rewrite(_rule("slice-slice"), (7,), lambda bd, x: bd.op(
            "slice", bd.op("slice", x, dim=0, start=a, end=b, step=c), dim=0, start=d, end=e, step=f))
        if got is not False and (list(range(7))[got["start"]:got["end"]:got["step"]] if got else []) != want:
            return f"counterexample: x[{a}:{b}:{c}][{d}:{e}:{f}] rewritten to {got}"
    return PROVED


def prove_permute_permute(max_rank: int = 5, compose=lambda p, q, gather: gather(p, q)) -> str:
    """permute(permute(x, p), q) = permute(x, d) with d[j] = p[q[j]], for symbolic
    permutations p, q of each rank up to `max_rank`: equal shapes, and every result index
    reads the same element of x. Then the rule is run on every pair of rank-3 permutations.
    `compose(p, q, gather)` is the formula proved (tests pass wrong ones)."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    for rank in range(1, max_rank + 1):
        p, q, i, s = (z3.IntVector(name, rank) for name in "pqis")
        perms = [z3.Distinct(*p), z3.Distinct(*q)] + [z3.And(0 <= v, v < rank) for v in p + q]

        def gather(vec, dims):  # vec[dims[j]] for each j: a permuted shape
            return [z3.Sum([z3.If(dims[j] == k, vec[k], 0) for k in range(rank)]) for j in range(rank)]

        def scatter(index, dims):  # the input index a result index reads: a[dims[j]] = index[j]
            return [z3.Sum([z3.If(dims[j] == k, index[j], 0) for j in range(rank)]) for k in range(rank)]

        d = compose(p, q, gather)
        claim = z3.And([z3.Distinct(*d)] + [a == b for a, b in zip(gather(gather(s, p), q), gather(s, d))]
                       + [a == b for a, b in zip(scatter(scatter(i, q), p), scatter(i, d))])
        if not _valid(claim, *perms):
            return f"counterexample at rank {rank}"
    for p, q in itertools.product(itertools.permutations(range(3)), repeat=2):
        got = _rewrite(_rule("permute-permute"), (2, 3, 4), lambda bd, x: bd.op(
            "permute", bd.op("permute", x, dims=list(p)), dims=list(q)))
        if not got or list(got["dims"]) != [p[j] for j in q]:
            return f"counterexample: the rule composes {p} then {q} into {got}"
    return PROVED


def prove_index_rules() -> dict[str, str]:
    return {name: prove() for name, prove in _INDEX_PROOFS.items()}


def _rule(name: str) -> Rule:
    return next(r for r in all_rules() if r.name == name)


def _rewrite(rule: Rule, shape, build):
    """The attributes of the node `rule` rewrites `build`'s graph into; None when the rule
    rejects it, False when the graph itself cannot be built."""
    probe = dataclasses.replace(rule, examples=(Example((shape,), build),))
    try:
        dag, roots, _ = example_dag(probe, 0)
    except Reject:
        return False
    try:
        new = rewrite_example(probe, dag, roots)[0]
    except Reject:
        return None
    return thaw(dag.node_of[new].attrs)


_INDEX_PROOFS = {"slice-slice": prove_slice_slice, "permute-permute": prove_permute_permute}
