"""The model zoo: real architectures beyond the five benchmark models, to test coverage.

`ZOO` maps a name to `builder(small) -> BenchmarkModel`; `models.BUILDERS` holds every
entry as `zoo-<name>`, so the bench and the CLI reach them (`opweave bench --zoo`). The
small variants are test sizes; the others are standard sizes (see the two modules).
Random weights from configs; nothing is downloaded.

Training uses a generic head: the mean squared error of the first output against a fixed
random target, which exercises every weight's gradient without a task-specific head.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from . import zoo_cnn, zoo_transformers
from .base import BenchmarkModel


def _first(outputs) -> torch.Tensor:
    """The first tensor of a model's outputs (a tensor, a tuple or a ModelOutput)."""
    return torch.utils._pytree.tree_leaves(outputs)[0]


class FirstOutputLoss(torch.nn.Module):
    """The model, then the mean squared error of its first output against `targets`."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs_and_targets):
        *inputs, targets = inputs_and_targets
        return F.mse_loss(_first(self.model(*inputs)), targets)


def _entry(name: str, source, small: bool) -> BenchmarkModel:
    module, inputs, notes = source.build(name, small)
    with torch.no_grad():
        shape = _first(module(*inputs)).shape
    return BenchmarkModel(name=f"zoo-{name}", module=module, inputs=inputs,
                          loss_module=FirstOutputLoss(module), targets=torch.randn(shape),
                          notes=notes)


ZOO: dict[str, Callable[[bool], BenchmarkModel]] = {
    **{n: functools.partial(_entry, n, zoo_transformers) for n in zoo_transformers.SPECS},
    **{n: functools.partial(_entry, n, zoo_cnn) for n in zoo_cnn.NAMES},
}
