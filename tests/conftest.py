"""Shared fixtures: the small variants of the benchmark models, built once per session."""
from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

# No wall-clock deadline decides a compile under test (rewrite saturation, extraction and
# partition ILPs run to their work limits), so results are the same on a fast or a slow,
# idle or loaded machine. Tests of the deadlines themselves pass explicit options.
os.environ["OPWEAVE_DETERMINISTIC"] = "1"
# The native runtime is built before the first call that replays (never raced by a
# background build), so which path a test's calls take does not depend on timing.
os.environ["OPWEAVE_NATIVE"] = "wait"
# Measured choices go to a database of this test process, never the user's.
os.environ["OPWEAVE_TUNING_DB"] = os.path.join(tempfile.mkdtemp(prefix="opweave-tests-"),
                                               "tuning.sqlite")

# Without a GPU, generated Triton kernels run on the CPU through Triton's interpreter (read
# when a kernel is defined, so before any is).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from opweave import models, tune  # noqa: E402

# ... and options built in code (`Options(...)`, whose tuning_db is "default") use it too:
# the user's own database (a roofline `opweave tune machine` stored there) changed what a
# compile under test reported
tune.default_path = lambda: Path(os.environ["OPWEAVE_TUNING_DB"])

MODEL_NAMES = ("bert-base", "vit-b16", "resnet50", "xmlcnn", "gcn", "gcn-dense")


@functools.lru_cache(maxsize=None)
def small_model(name: str) -> models.BenchmarkModel:
    return models.build(name, small=True)


@functools.lru_cache(maxsize=None)
def compiled_small(name: str):
    import warnings

    import opweave
    from opweave.frontends.program import OpweaveFallbackWarning

    bench = small_model(name)
    with warnings.catch_warnings():
        # a fallback (or a capture other than export) in a benchmark model is a failure
        warnings.simplefilter("error", OpweaveFallbackWarning)
        return opweave.compile(bench.module.eval(), bench.inputs, name=name)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
