"""z3 proofs of rewrite rules: exact rules are proved, inexact and wrong ones get
counterexamples that really are counterexamples, index formulas are proved."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("z3")

from opweave.tools.rule_proofs import (PROVED, prove_all, prove_index_rules,  # noqa: E402
                                          prove_permute_permute, prove_rule)
from opweave.passes.rewrite.rule import RULES, Rule, all_rules  # noqa: E402
from opweave.passes.rewrite.rules._helpers import X, Y, example, op  # noqa: E402
from opweave.passes.rewrite.soundness import check_rule  # noqa: E402


def registered(name: str) -> Rule:
    all_rules()  # registers the rules
    return RULES[name]


def counterexample_inputs(outcome: str) -> list[np.float32]:
    """The input values of a 'counterexample: in0=..., in1=... gives ...' outcome."""
    assert outcome.startswith("counterexample:"), outcome
    return [np.float32(v) for v in re.findall(r"in\d+=(\S+?)(?:,| gives)", outcome)]


@pytest.mark.parametrize("name", ["mul-one", "neg-neg", "add-commute", "mul-commute",
                                  "div-pow2-to-mul", "mul-two-to-add", "sub-zero", "maximum-commute",
                                  "relu-relu", "abs-neg", "clamp-clamp", "sub-to-add-neg"])
def test_exact_rules_are_proved(name):
    assert prove_rule(registered(name)) == PROVED


def test_float_addition_is_not_associative():
    outcome = prove_rule(registered("add-associate"))
    x, y, z = (torch.tensor(v) for v in counterexample_inputs(outcome))
    assert x.dtype == torch.float32
    assert not torch.equal((x + y) + z, x + (y + z))


def test_a_wrong_rule_gets_a_counterexample():
    wrong = Rule("sub-commute-wrong", op("sub", X, Y), lambda b, m: b.op("sub", m["y"], m["x"]),
                 "algebra", (example(lambda b, x, y: b.op("sub", x, y), (2, 3), (2, 3)),))
    x, y = counterexample_inputs(prove_rule(wrong))
    assert x - y != y - x


def test_z3_finds_what_random_testing_misses():
    """max(x, min(x, y)) = x fails only when y is NaN: the numerical check passes it."""
    absorb = Rule("max-min-absorb", op("maximum", X, op("minimum", X, Y)), lambda b, m: m["x"],
                  "simplify", (example(lambda b, x, y: b.op("maximum", x, b.op("minimum", x, y)),
                                       (2, 3), (2, 3)),))
    assert check_rule(absorb) == []
    x, y = counterexample_inputs(prove_rule(absorb))
    assert np.isnan(y) and not np.isnan(x)


def test_what_z3_cannot_decide_is_said_so():
    assert prove_rule(registered("matmul-associate")).startswith("not decidable here (matmul")
    # pow is an uninterpreted function; pow(x, 1) = x cannot be proved from that alone
    assert prove_rule(registered("pow-one")).startswith("not decidable here (pow")


def _rsqrt_impl(monkeypatch, impl):
    """rsqrt's reference made to differ from 1/sqrt(x) by design (or not at all): whether
    torch's own rsqrt rounds like 1/sqrt depends on the CPU's vector unit."""
    from opweave.ir import registry

    monkeypatch.setattr(registry.get("rsqrt"), "impl", impl)


def test_inexact_rules_with_uninterpreted_ops_are_refuted_by_torch(monkeypatch):
    """rsqrt is uninterpreted for z3; a difference torch reproduces is a counterexample."""
    _rsqrt_impl(monkeypatch, lambda x: torch.nextafter(1 / torch.sqrt(x), torch.tensor(float("inf"))))
    (x,) = counterexample_inputs(prove_rule(registered("rsqrt")))
    x = torch.tensor(x)
    assert not torch.equal(torch.nextafter(1 / torch.sqrt(x), torch.tensor(float("inf"))),
                           1 / torch.sqrt(x))


def test_counterexamples_torch_does_not_reproduce_are_not_claimed(monkeypatch):
    """With an rsqrt that rounds exactly like 1/sqrt, the rule stays undecided (z3 spends
    its work budget, or finds an f that torch does not reproduce), never a made-up
    counterexample."""
    _rsqrt_impl(monkeypatch, lambda x: 1 / torch.sqrt(x))
    outcome = prove_rule(registered("rsqrt"), budget=1_000_000)  # a count: same everywhere
    assert outcome.startswith("not decidable here ("), outcome


def test_index_rules_are_proved():
    assert prove_index_rules() == {"slice-slice": PROVED, "permute-permute": PROVED}
    assert prove_rule(registered("slice-slice")) == PROVED


def test_a_wrong_permutation_formula_is_refuted():
    # q[p[j]] equals p[q[j]] only when p and q commute: always at rank 2, not at rank 3
    assert prove_permute_permute(2, lambda p, q, j: q[p[j]]) == PROVED
    outcome = prove_permute_permute(3, lambda p, q, j: q[p[j]])
    assert outcome.startswith("counterexample") and "rank 3" in outcome


def test_prove_all_names_every_rule():
    rules = [registered(n) for n in ("mul-one", "add-associate", "reshape-reshape")]
    outcomes = prove_all(rules)
    assert list(outcomes) == ["mul-one", "add-associate", "reshape-reshape"]
    assert outcomes["mul-one"] == PROVED
    assert outcomes["add-associate"].startswith("counterexample")
    assert outcomes["reshape-reshape"].startswith("not decidable here")
