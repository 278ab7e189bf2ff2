"""What a benchmark model exposes: a module, inference inputs, and a training loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BenchmarkModel:
    """A model built from a config with random weights, ready to run.

    `module(*inputs)` is the inference model (batch 1 unless the model is a whole graph,
    like GCN). `loss_module(*inputs, targets)` returns the scalar training loss; it shares
    its parameters with `module` and adds the task head where the model needs one.
    """

    name: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_module: torch.nn.Module
    targets: torch.Tensor
    notes: str = ""

    def eager_outputs(self):
        with torch.no_grad():
            return self.module.eval()(*self.inputs)

    def training_loss(self) -> torch.Tensor:
        self.loss_module.train()
        return self.loss_module(*self.inputs, self.targets)
