"""Prove rules with z3 where a solver can decide them, instead of trusting random tests.

Elementwise rules: both sides of each example become z3 IEEE float32 terms (round to
nearest, ties to even; no flush to zero) over one symbolic element per graph input. One
element suffices: every op is one-to-one under broadcasting, so each output element is
the same function of one element of each input, and any input value can occur. Constants
with several elements are proved once per distinct combination of their elements. Equal
means both NaN, or `fpEQ`: so -0 == +0 counts as equal (a rule may flip a zero's sign).

Outcomes: "proved exact"; "counterexample: <values>" (it holds within rounding at best;
torch finds most on random inputs before z3 is asked, and z3's are replayed in torch);
or "not decidable here (<reason>)". Ops z3 cannot model exactly (exp, tanh, pow, ...)
become uninterpreted functions: a proof holds for every function, so for them too, but a
counterexample counts only if torch reproduces it.

Index rules (slice-slice, permute-permute): their composition formulas are proved over
symbolic integers, and the rules are run to check that they compute those formulas.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import struct

import numpy as np
import torch

from ..ir import Graph
from ..passes.rewrite.rule import Example, Reject, Rule, all_rules
from ..passes.rewrite.soundness import example_dag, rewrite_example, run
from ..passes.rewrite.term import TermDag, thaw

try:
    import z3
except ImportError:  # pragma: no cover - z3-solver is an optional dependency
    z3 = None

PROVED = "proved exact"
# z3's work budget per query ("rlimit": counted solver steps, not seconds; about 2 s on a
# 2-core EPYC). A deadline in seconds decides differently on a faster or slower CPU; a
# step count gives the same outcome on every machine for one z3 version.
BUDGET = 10_000_000
MAX_CONSTANT_TUPLES = 16
_OPAQUE = {"exp", "log", "log1p", "rsqrt", "sigmoid", "tanh", "erf", "gelu", "sin", "cos", "pow"}
_MODELED = {"input", "constant", "add", "sub", "mul", "div", "neg", "abs", "sqrt", "reciprocal",
            "relu", "maximum", "minimum", "clamp", "cast"} | _OPAQUE


class Undecidable(Exception):
    """The graph is outside what the encoding models."""


def _fp(value: float, ctx=None):
    return z3.FPVal(float(np.float32(value)), fps=z3.Float32(ctx), ctx=ctx)


def _float(model, expr) -> float:
    v = model.eval(expr, model_completion=True)  # (fpToIEEEBV leaves NaN's bits free)
    if v.isNaN() or v.isInf():
        return float("nan") if v.isNaN() else -float("inf") if v.isNegative() else float("inf")
    bits = (v.sign() << 31) | (v.exponent_as_long(True) << 23) | v.significand_as_long()
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class _Z3In:
    """z3's float functions bound to one context (they default to the main one)."""

    def __init__(self, ctx):
        self.ctx = ctx

    def __getattr__(self, name: str):
        return functools.partial(getattr(z3, name), ctx=self.ctx)


class Encoder:
    """z3 terms (in z3 context `ctx`; None: the main one) for the classes of one dag, with
    constants taken from `values`."""

    def __init__(self, dag: TermDag, values: dict[str, float], names=None, ctx=None):
        self.dag, self.values, self.names, self.ctx = dag, values, names, ctx
        self.inputs: dict[int, object] = {}  # input index -> FP variable
        self.opaque: set[str] = set()        # ops encoded as uninterpreted functions
        self.signed_zero = False             # a max/min chose between -0 and +0
        self._functions, self._memo = {}, {}

    def term(self, cid: int):
        if cid not in self._memo:
            node = self.dag.node_of[cid]
            self._memo[cid] = self._node(node, [self.term(c) for c in node.children])
        return self._memo[cid]

    def _node(self, node, a):
        op, rm, f32, fp = node.op, z3.RNE(self.ctx), z3.Float32(self.ctx), _Z3In(self.ctx)
        c = lambda v: _fp(v, self.ctx)  # noqa: E731
        if op == "input":
            k = node.attr("index")
            name = self.names[k] if self.names else f"in{k}"
            return self.inputs.setdefault(k, z3.FP(name, f32))
        if op == "constant":
            return c(self.values[node.attr("name")])
        if op == "div" and node.attr("rounding") != "none":
            raise Undecidable(f"div rounding={node.attr('rounding')}")
        exact = {"add": lambda x, y: fp.fpAdd(rm, x, y), "sub": lambda x, y: fp.fpSub(rm, x, y),
                 "mul": lambda x, y: fp.fpMul(rm, x, y), "div": lambda x, y: fp.fpDiv(rm, x, y),
                 "neg": fp.fpNeg, "abs": fp.fpAbs, "sqrt": lambda x: fp.fpSqrt(rm, x),
                 "reciprocal": lambda x: fp.fpDiv(rm, c(1.0), x),
                 "relu": lambda x: z3.If(fp.fpLT(x, c(0.0)), c(0.0), x),  # -0, NaN stay
                 "cast": lambda x: x}  # float32 to float32 (types are checked)
        if op in exact:
            return exact[op](*a)
        if op in ("maximum", "minimum"):
            return self._extremum(op == "maximum", a[0], a[1])
        if op == "clamp":  # below min, then above max (max wins when min > max)
            lo, hi, x = node.attr("min"), node.attr("max"), a[0]
            x = x if lo is None else z3.If(fp.fpLT(x, c(lo)), c(lo), x)
            return x if hi is None else z3.If(fp.fpGT(x, c(hi)), c(hi), x)
        if op in _OPAQUE:
            self.opaque.add(op)
            key = (op, node.attrs)
            if key not in self._functions:
                sorts = [f32] * (len(a) + 1)
                self._functions[key] = z3.Function(f"{op}{len(self._functions)}", *sorts)
            return self._functions[key](*a)
        raise Undecidable(f"{op} is not an elementwise op z3 models")

    def _extremum(self, is_max: bool, x, y):
        """torch.maximum/minimum: NaN propagates; between -0 and +0 torch's vector and scalar
        paths disagree, so the sign of that zero is left free."""
        choice, fp = z3.FreshBool("zero_sign", self.ctx), _Z3In(self.ctx)
        self.signed_zero = True
        better = fp.fpGT(x, y) if is_max else fp.fpLT(x, y)
        worse = fp.fpLT(x, y) if is_max else fp.fpGT(x, y)
        pick = z3.If(better, x, z3.If(worse, y, z3.If(choice, x, y)))
        return z3.If(z3.Or(fp.fpIsNaN(x), fp.fpIsNaN(y)), z3.fpNaN(z3.Float32(self.ctx)), pick)


def _cone(dag: TermDag, roots: list[int]) -> list[int]:
    """The classes the roots read, when all are float32 values of ops the encoder models."""
    classes = dag.reachable(roots)
    if any(dag.node_of[c].op not in _MODELED for c in classes):
        op = next(dag.node_of[c].op for c in classes if dag.node_of[c].op not in _MODELED)
        raise Undecidable(f"{op} is not an elementwise op z3 models")
    for cid in classes:
        if isinstance(dag.type(cid), tuple) or dag.type(cid).dtype != torch.float32:
            raise Undecidable(f"{dag.node_of[cid].op} computes {dag.type(cid)}, not float32")
    return classes


def _constant_tuples(dag: TermDag, classes: list[int]) -> list[dict[str, float]]:
    """Each distinct combination of constant elements that one output element can see."""
    names = sorted({dag.node_of[c].attr("name") for c in classes if dag.node_of[c].op == "constant"})
    if not names:
        return [{}]
    tensors = torch.broadcast_tensors(*(dag.store.data(n) for n in names))
    rows = torch.unique(torch.stack([t.reshape(-1) for t in tensors], 1), dim=0)
    if len(rows) > MAX_CONSTANT_TUPLES:
        raise Undecidable(f"{len(rows)} combinations of constant elements")
    return [dict(zip(names, row.tolist())) for row in rows]


def _differ(a, b):
    fp = _Z3In(a.ctx)
    return z3.Not(z3.Or(z3.And(fp.fpIsNaN(a), fp.fpIsNaN(b)), fp.fpEQ(a, b)))


def _first_difference(dag, lhs, rhs, template, inputs):
    """Run both sides in torch: the first pair of output elements that differ (not both
    NaN, not ==) as (values of the used inputs there, lhs value, rhs value); or None."""
    for a, b in zip(run(dag, lhs, template, inputs), run(dag, rhs, template, inputs)):
        a, b = torch.broadcast_tensors(a, b)
        differ = ~((a == b) | (a.isnan() & b.isnan()))
        if differ.any():
            i = differ.reshape(-1).nonzero()[0, 0].item()
            at = {k: torch.broadcast_to(x, a.shape).reshape(-1)[i].item() for k, x in enumerate(inputs)}
            return at, a.reshape(-1)[i].item(), b.reshape(-1)[i].item()
    return None


def _shown(values: dict[int, float], names) -> str:
    return ", ".join(f"{names[k] if names else f'in{k}'}={np.float32(v)!s}"
                     for k, v in sorted(values.items())) or "any input"


def _text(values: dict[int, float], a: float, b: float, names) -> str:
    return f"counterexample: {_shown(values, names)} gives {np.float32(a)!s} vs {np.float32(b)!s}"


def probe(dag, lhs, rhs, template: Graph, used: set[int], names=None, seeds: int = 3) -> str | None:
    """Look for a counterexample with torch on random inputs (compared exactly) before
    asking z3: a difference found by running the graphs is real, and z3 can take long to
    find the one that reassociating a sum makes."""
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        scale = 10.0 ** (3 * (seed % 3) - 3)
        inputs = [torch.randn(v.type.shape, generator=gen) * scale for v in template.inputs]
        found = _first_difference(dag, lhs, rhs, template, inputs)
        if found:
            return _text({k: v for k, v in found[0].items() if k in used}, *found[1:], names)
    return None


def prove_dag(dag: TermDag, lhs: list[int], rhs: list[int], template: Graph | None = None,
              budget: int = BUDGET, names=None, probe_first: bool = True,
              ctx=None) -> str:
    """Whether classes `lhs` and `rhs` of `dag` are equal for every float32 input.
    With a `template` (the graph inputs), torch first probes random inputs (unless
    `probe_first` is false), and z3's counterexamples are replayed through torch.
    Threads may prove concurrently, each with its own z3 context `ctx`."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    try:
        cone = _cone(dag, lhs + rhs)
        tuples = _constant_tuples(dag, cone)
        if template is not None and probe_first:
            used = {dag.node_of[c].attr("index") for c in cone if dag.node_of[c].op == "input"}
            found = probe(dag, lhs, rhs, template, used, names)
            if found:
                return found
        for values in tuples:
            enc = Encoder(dag, values, names, ctx)
            pairs = [(enc.term(a), enc.term(b)) for a, b in zip(lhs, rhs)]
            # bit-blasting directly is faster on pure float formulas; uninterpreted
            # functions need the general solver
            solver = z3.Solver(ctx=ctx) if enc.opaque else z3.Then(
                "simplify", "fpa2bv", "simplify", "bit-blast", "sat", ctx=ctx).solver()
            solver.set("rlimit", budget)
            solver.add(z3.Or([_differ(a, b) for a, b in pairs]))
            result = solver.check()
            if result == z3.unknown:
                raise Undecidable(_unknown_reason(solver))
            if result == z3.sat:
                return _counterexample(dag, lhs, rhs, template, enc, solver.model(), pairs)
    except Undecidable as err:
        return f"not decidable here ({err})"
    return PROVED


def _unknown_reason(solver) -> str:
    reason = solver.reason_unknown()
    if reason in ("canceled", "max. resource limit exceeded"):
        return "z3 spent its work budget"
    return f"z3: {reason}"


def _counterexample(dag, lhs, rhs, template, enc: Encoder, model, pairs) -> str:
    """z3's counterexample, replayed through torch when there is a template."""
    values = {k: _float(model, v) for k, v in enc.inputs.items()}
    found = None
    if template is not None:
        inputs = [torch.full(v.type.shape, values.get(k, 1.0)) for k, v in enumerate(template.inputs)]
        found = _first_difference(dag, lhs, rhs, template, inputs)
    if found:
        return _text(values, *found[1:], enc.names)
    if enc.opaque or enc.signed_zero:
        why = ", ".join(sorted(enc.opaque)) or "the sign of a zero from max/min"
        raise Undecidable(f"{why} not modeled exactly; z3's counterexample {_shown(values, enc.names)} "
                          + ("is not run" if template is None else "does not reproduce in torch"))
    l, r = next((l, r) for l, r in pairs if z3.is_true(model.eval(_differ(l, r), True)))
    suffix = "" if template is None else " (torch does not reproduce it)"
    return _text(values, _float(model, l), _float(model, r), enc.names) + suffix


def prove_rule(rule: Rule, budget: int = BUDGET) -> str:
    """Prove `rule` on each of its examples (index rules: on their formulas); `budget`
    is z3's work budget per query."""
    if rule.name in _INDEX_PROOFS:
        return _INDEX_PROOFS[rule.name]()
    for i in range(len(rule.examples)):
        try:
            dag, roots, template = example_dag(rule, i)
            new_roots = rewrite_example(rule, dag, roots)
        except Reject as err:
            return f"not decidable here (example {i} does not rewrite: {err})"
        outcome = prove_dag(dag, roots, new_roots, template, budget)
        if outcome != PROVED:
            return outcome + (f" [example {i}]" if len(rule.examples) > 1 else "")
    return PROVED


def prove_all(rules: list[Rule] | None = None, budget: int = BUDGET) -> dict[str, str]:
    """Rule name -> outcome, for `rules` (default: every registered rule)."""
    return {r.name: prove_rule(r, budget) for r in (all_rules() if rules is None else rules)}


# -- index rules ----------------------------------------------------------------------------

def _refute(claim, *assumptions) -> str | None:
    """None when the assumptions imply `claim`; else why not."""
    solver = z3.Solver()
    solver.set("rlimit", BUDGET)
    solver.add(*assumptions, z3.Not(claim))
    result = solver.check()
    if result == z3.unsat:
        return None
    return f"counterexample: {solver.model()}" if result == z3.sat else \
        f"not decidable here ({_unknown_reason(solver)})"


def prove_slice_slice() -> str:
    """x[s1::t1][s2::t2] is x[s1 + t1 s2 :: t1 t2] (starts >= 0: Python's range normalizes
    them), and ending at the last element + 1, as the rule does, keeps exactly n elements.
    Then the rule runs on a grid of slices, negative and overlong bounds included."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    s1, t1, s2, t2, k, n = z3.Ints("s1 t1 s2 t2 k n")
    ranges = [s1 >= 0, t1 >= 1, s2 >= 0, t2 >= 1, k >= 0, n >= 1]
    start, step = s1 + t1 * s2, t1 * t2
    end = start + step * (n - 1) + 1
    for what, claim in (("element k", s1 + t1 * (s2 + t2 * k) == start + step * k),
                        ("length", (end - start + step - 1) / step == n)):  # len(range(...))
        failed = _refute(claim, *ranges)
        if failed:
            return f"{failed} (the composed slice's {what})"
    grid = [(s, e, t) for s in (-8, -3, 0, 2) for e in (-1, 4, 100) for t in (1, 3)]
    for (a, b, c), (d, e, f) in itertools.product(grid, grid):
        got = _rewrite("slice-slice", (7,), lambda bd, x: bd.op(
            "slice", bd.op("slice", x, dim=0, start=a, end=b, step=c), dim=0, start=d, end=e, step=f))
        seven = list(range(7))
        if got is not False and (seven[got["start"]:got["end"]:got["step"]] if got else []) \
                != seven[a:b:c][d:e:f]:
            return f"counterexample: the rule rewrites x[{a}:{b}:{c}][{d}:{e}:{f}] to {got}"
    return PROVED


def prove_permute_permute(max_rank: int = 5, compose=lambda p, q, j: p[q[j]]) -> str:
    """permute(permute(x, p), q) = permute(x, d) with d[j] = p[q[j]], for symbolic
    permutations p, q (z3 arrays) of each rank up to `max_rank`. permute(y, q) at index i
    reads y at the index b with b[q[j]] = i[j], and its shape is shape(y)[q[j]]; the claim
    is that d is a permutation and both sides read the same element and have the same
    shape. Then the rule runs on every pair of rank-3 permutations. `compose(p, q, j)` is
    the formula proved (tests pass wrong ones)."""
    if z3 is None:
        return "not decidable here (z3 is not installed)"
    for rank in range(1, max_rank + 1):
        p, q, i, b, a, s = (z3.Array(name, z3.IntSort(), z3.IntSort()) for name in "pqibas")
        js = range(rank)
        d = [compose(p, q, j) for j in js]
        facts = [z3.Distinct(*[p[j] for j in js]), z3.Distinct(*[q[j] for j in js])]
        facts += [z3.And(0 <= m[j], m[j] < rank) for m in (p, q) for j in js]
        facts += [b[q[j]] == i[j] for j in js] + [a[p[k]] == b[k] for k in js]
        claim = z3.And([z3.Distinct(*d)] + [z3.And(0 <= e, e < rank) for e in d]
                       + [a[e] == i[j] for j, e in zip(js, d)]           # the same element
                       + [s[p[q[j]]] == s[e] for j, e in zip(js, d)])    # the same shape
        failed = _refute(claim, *facts)
        if failed:
            return f"{failed} (rank {rank})"
    for p, q in itertools.product(itertools.permutations(range(3)), repeat=2):
        got = _rewrite("permute-permute", (2, 3, 4), lambda bd, x: bd.op(
            "permute", bd.op("permute", x, dims=list(p)), dims=list(q)))
        if not got or list(got["dims"]) != [p[j] for j in q]:
            return f"counterexample: the rule composes {p} then {q} into {got}"
    return PROVED


def prove_index_rules() -> dict[str, str]:
    return {name: prove() for name, prove in _INDEX_PROOFS.items()}


def _rewrite(name: str, shape, build):
    """The attributes of the node rule `name` rewrites `build`'s graph into; None when the
    rule rejects it, False when the graph itself cannot be built."""
    rule = next(r for r in all_rules() if r.name == name)
    rule = dataclasses.replace(rule, examples=(Example((shape,), build),))
    try:
        dag, roots, _ = example_dag(rule, 0)
    except Reject:
        return False
    try:
        return thaw(dag.node_of[rewrite_example(rule, dag, roots)[0]].attrs)
    except Reject:
        return None


_INDEX_PROOFS = {"slice-slice": prove_slice_slice, "permute-permute": prove_permute_permute}
