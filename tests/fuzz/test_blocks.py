"""`opweave fuzz --blocks`: random networks of model blocks in each precision against
float64, and the checks that find a wrong result or a changed input."""
from __future__ import annotations

import pytest
import torch

import opweave
from opweave import cli
from opweave.codegen import precision as prec
from opweave.fuzz import blocks

SEEDS = range(3)


def test_the_draws_cover_the_blocks():
    kinds, masked, taps = set(), 0, 0
    for seed in range(40):
        model, inputs = blocks.draw(seed)
        kinds.update(k[0] for k in model.kinds)
        masked += isinstance(model, blocks.SeqNet) and model.masked
        taps += bool(model.taps)
        with torch.no_grad():
            assert all(torch.isfinite(y).all() for y in model(*inputs))
    assert kinds == {"conv", "bottleneck", "pool", "cat", "pointwise", "same-padding",
                     "patches", "attention", "mlp", "linear"}
    assert masked and taps


@pytest.mark.parametrize("precision", list(blocks.TOLERANCES))
def test_random_networks_match_float64_with_forms_drawn_at_random(precision):
    failures = []
    assert blocks.run(SEEDS, precision, forms_at_random=True, log=failures.append) == 0, failures


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_random_networks_match_float64_with_measured_forms(precision):
    failures = []
    assert blocks.run(range(10, 12), precision, log=failures.append) == 0, failures


def test_a_wrong_bf16_rounding_is_found(monkeypatch):
    """Operands rounded wrongly (scaled by 1.5 first) by every bf16 step: the check must
    report it, so a passing run means something."""
    right = prec.narrow
    monkeypatch.setattr(prec, "narrow", lambda t: right(t * 1.5 if isinstance(t, torch.Tensor)
                                                        and t.dtype == torch.float32 else t))
    found = [seed for seed in range(4) if blocks.check(seed, "bf16", forms_at_random=True)]
    assert found


def test_an_input_a_call_changes_is_found(monkeypatch):
    compile_ = opweave.compile

    def changing(model, inputs, **kwargs):
        compiled = compile_(model, inputs, **kwargs)

        def call(*args):
            result = compiled(*args)
            args[0].mul_(1.0000001)
            return result
        return call
    monkeypatch.setattr(opweave, "compile", changing)
    assert "input 0 was changed" in blocks.check(0, "fp32")


def test_a_result_a_later_call_overwrites_is_found(monkeypatch):
    compile_ = opweave.compile

    def reusing(model, inputs, **kwargs):
        compiled, held = compile_(model, inputs, **kwargs), []

        def call(*args):
            result = compiled(*args)
            if not held:
                held.extend(torch.empty_like(y) for y in result)
            return tuple(h.copy_(y) for h, y in zip(held, result))  # the same tensors each call
        return call
    monkeypatch.setattr(opweave, "compile", reusing)
    assert "call 1, output 0 changed at a later call" in blocks.check(0, "fp32")


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        blocks.check(0, "fp16")


def test_the_cli_runs_blocks(capsys):
    assert cli.main(["fuzz", "--blocks", "1", "--seed", "5", "--precision", "fp32"]) == 0
    assert "1 of 1 networks in fp32 matched float64" in capsys.readouterr().out
    assert cli.main(["fuzz", "--blocks", "-1"]) == 2
