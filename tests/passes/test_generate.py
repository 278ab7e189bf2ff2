"""TASO-style rule generation: enumeration, pruning, verification, proofs, coverage."""
from __future__ import annotations

import pytest

pytest.importorskip("z3")

from opweave.tools.rule_generation import (Values, generate, redundant,  # noqa: E402
                                             sample_inputs)

x, y = ("input", 0), ("input", 1)


def test_generate_finds_verifies_and_proves_rules():
    # no clock: bounded by z3's work budget and saturation's iterations, so the same
    # report on every machine
    report = generate(max_ops=2, time_budget=None)
    assert report.graphs > report.candidates >= report.verified >= 1
    rest = report.verified - report.redundant
    assert rest == len(report.rules) >= 1
    assert report.proved_exact + report.inexact + report.undecided == rest
    assert 0 < report.new <= rest and report.proved_exact > 0 and report.inexact > 0
    assert report.examples and not report.cut_short
    rules = {text: (status, covered) for text, status, covered in report.rules}
    # known to the rule set (simplify's identities), and proved
    assert rules["neg(neg(x)) == x"] == ("proved exact", True)
    assert rules["add(x, 0) == x"] == ("proved exact", True)
    # new: no existing rule turns max(x, 0) into relu(x)
    assert rules["maximum(x, 0) == relu(x)"] == ("proved exact", False)
    # holds on tests, not exactly: (y + (x - y)) rounds
    assert rules["add(y, sub(x, y)) == x"][0] == "inexact"
    assert len(str(report).splitlines()) == 1 + len(report.examples)


def test_a_spent_time_budget_cuts_stages_short_consistently():
    report = generate(max_ops=2, time_budget=0)  # the deadline has passed at once
    assert report.cut_short
    assert report.verified <= report.candidates
    assert report.new <= report.verified - report.redundant


def test_instances_of_smaller_rules_are_redundant():
    values = Values(sample_inputs(0, 3))
    fresh = ("input", 2)
    inner = ("exp", x)
    assert redundant(("relu", ("relu", inner)), ("relu", inner), values, fresh)
    assert not redundant(("neg", ("neg", x)), x, values, fresh)
