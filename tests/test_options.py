"""One options object: defaults, the environment read in one place, validation with the
option named, explicit arguments over the environment."""
from __future__ import annotations

import math

import pytest

from opweave.options import Options


def test_defaults_without_environment():
    options = Options.from_env({})
    assert options == Options(tuned=True)  # from the environment: tuned records are used
    assert not Options().tuned  # an Options a caller writes says what it wants
    assert options.fusion == "ilp" and options.rewrite.engine == "eqsat"
    assert options.measure and not options.deterministic and options.debug_dir is None


def test_environment_overrides():
    env = {"OPWEAVE_REWRITE": "greedy", "OPWEAVE_FUSION": "off", "OPWEAVE_MEASURE": "0",
           "OPWEAVE_DEBUG": "1", "OPWEAVE_DEBUG_DIR": "/tmp/x"}
    options = Options.from_env(env)
    assert options.rewrite.extractor == "greedy" and options.fusion == "off"
    assert not options.measure and options.debug_dir == "/tmp/x"
    assert Options.from_env({"OPWEAVE_DEBUG": "1"}).debug_dir == "opweave_debug"
    assert Options.from_env({"OPWEAVE_DEBUG": "0"}).debug_dir is None


def test_arguments_win_over_the_environment():
    env = {"OPWEAVE_REWRITE": "off", "OPWEAVE_FUSION": "greedy"}
    options = Options.resolve(None, rewrite="eqsat", fusion=False, env=env)
    assert options.rewrite.engine == "eqsat" and options.fusion == "off"
    given = Options(fusion="greedy")
    assert Options.resolve(given, env=env) is given


def test_deterministic_removes_every_deadline():
    options = Options.from_env({"OPWEAVE_DETERMINISTIC": "1"})
    assert options.rewrite.limits.seconds == math.inf
    assert options.rewrite.ilp_seconds == math.inf == options.rewrite.backtrack_seconds
    assert options.partition_seconds == math.inf
    # an engine chosen per call stays deterministic
    assert Options.resolve(options, rewrite="backtrack").rewrite.backtrack_seconds == math.inf


@pytest.mark.parametrize("env, message", [
    ({"OPWEAVE_FUSION": "fast"}, "fusion must be one of ilp, greedy, off; got 'fast'"),
    ({"OPWEAVE_REWRITE": "magic"}, "rewrite engine"),
    ({"OPWEAVE_MEASURE": "maybe"}, r"\$OPWEAVE_MEASURE must be 0 or 1"),
])
def test_bad_values_name_the_option(env, message):
    with pytest.raises(ValueError, match=message):
        Options.from_env(env)


def test_options_are_immutable_and_typed():
    with pytest.raises(Exception):
        Options().fusion = "off"  # type: ignore[misc]
    with pytest.raises(TypeError, match="opweave.Options"):
        Options.resolve({"fusion": "off"})  # type: ignore[arg-type]


def test_device_is_validated_and_resolved():
    assert Options().device is None
    assert Options.resolve(Options(), device="auto").device == "auto"
    assert Options(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, auto; got 'gpu'"):
        Options(device="gpu")
