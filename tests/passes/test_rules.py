"""Every rewrite rule is checked on its examples; a wrong rule is caught."""
from __future__ import annotations

import pytest
import torch

from opweave.passes.rewrite.rule import RULESETS, Rule, all_rules, rule
from opweave.passes.rewrite.rules._helpers import X, Y, example, op
from opweave.passes.rewrite.soundness import check_rule

RULES = all_rules()


def test_rule_set_is_large_and_every_set_is_used():
    assert len(RULES) >= 60
    for name in RULESETS:
        assert any(r.ruleset == name for r in RULES), f"rule set {name} is empty"
    assert len({r.name for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule_", RULES, ids=[r.name for r in RULES])
def test_rule_is_sound_on_its_examples(rule_):
    assert rule_.examples, "a rule that cannot be checked does not ship"
    assert check_rule(rule_) == []


def _wrong(name, lhs, rhs, build, *shapes):
    return Rule(name, lhs, rhs, "algebra", (example(build, *shapes),))


def test_a_numerically_wrong_rule_is_caught():
    bad = _wrong("sub-commute", op("sub", X, Y), lambda b, m: b.op("sub", m["y"], m["x"]),
                 lambda b, x, y: b.op("sub", x, y), (2, 3), (2, 3))
    problems = check_rule(bad)
    assert len(problems) == 1 and "differs by" in problems[0]


def test_a_rule_that_changes_the_type_is_caught():
    # composes the permutations in the wrong order: the shape changes
    bad = _wrong("permute-compose-wrong", op("permute", op("permute", X, bind="p"), bind="q"),
                 lambda b, m: b.op("permute", m["x"], dims=[m.node("q").attr("dims")[j]
                                                            for j in m.node("p").attr("dims")]),
                 lambda b, x: b.op("permute", b.op("permute", x, dims=[1, 2, 0]), dims=[0, 2, 1]),
                 (2, 3, 4))
    assert "would change" in check_rule(bad)[0]


def test_a_rule_whose_example_does_not_match_is_caught():
    bad = _wrong("never", op("exp", X), lambda b, m: m["x"], lambda b, x: b.op("neg", x), (2,))
    assert "does not apply" in check_rule(bad)[0]


def test_a_rule_without_examples_cannot_be_registered():
    with pytest.raises(ValueError, match="example"):
        rule("no-examples", op("neg", X), "algebra", [])(lambda b, m: m["x"])


def test_float_tolerance_is_tight_enough_to_catch_a_small_error():
    bad = _wrong("scale-drift", op("mul", X, Y),
                 lambda b, m: b.op("mul", b.op("mul", m["x"], m["y"]), b.scalar(1.001, torch.float32)),
                 lambda b, x, y: b.op("mul", x, y), (4,), (4,))
    assert check_rule(bad)
