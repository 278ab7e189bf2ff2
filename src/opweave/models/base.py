"""What a benchmark model exposes: a module, inference inputs, and a training loss."""
from __future__ import annotations

import dataclasses
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
    # The same model (shared weights, same outputs) in a form ONNX exporters accept, for
    # models whose own form does not export; None when `module` exports as it is.
    export_module: torch.nn.Module | None = None
    export_note: str = ""
    batched: bool = True  # False: the input is a whole graph (GCN), batch size does not apply

    def with_batch(self, size: int) -> "BenchmarkModel":
        """The same model on `size` copies of its sample (the inputs repeated along dim 0);
        itself when `size` is 1 or the model is not batched."""
        if size < 1:
            raise ValueError(f"batch size must be positive, not {size}")
        if size == 1 or not self.batched:
            return self

        def repeat(t: torch.Tensor) -> torch.Tensor:
            return t.repeat(size, *([1] * (t.dim() - 1)))

        return dataclasses.replace(self, inputs=tuple(repeat(x) for x in self.inputs),
                                   targets=repeat(self.targets))

    def eager_outputs(self):
        with torch.no_grad():
            return self.module.eval()(*self.inputs)

    def training_loss(self) -> torch.Tensor:
        self.loss_module.train()
        return self.loss_module(*self.inputs, self.targets)


def disable_dropout(module: torch.nn.Module) -> torch.nn.Module:
    """Set every dropout probability in `module` to zero, in place.

    Training benchmarks compare gradients across backends, which random masks would make
    incomparable; batch-norm batch statistics and everything else of train mode remain.
    Covers `nn.Dropout` modules and the float `dropout`/`attention_dropout` attributes that
    GCN and transformers' attention read.
    """
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for attr in ("dropout", "attention_dropout"):
            if isinstance(getattr(sub, attr, None), float):
                setattr(sub, attr, 0.0)
    return module


def like_trained(module: torch.nn.Module) -> torch.nn.Module:
    """Spread every constant-valued float parameter and buffer a little, in place.

    Freshly initialized models have zero biases, unit norm scales and zero-mean unit-variance
    running statistics; trained models do not. Without this, rewrites such as x + 0 = x
    would remove every bias add and make a random-weight model look faster than a real one.
    """
    gen = torch.Generator().manual_seed(1)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    with torch.no_grad():
        for name, t in tensors:
            if t.is_sparse or not t.is_floating_point() or t.numel() < 2 or t.min() != t.max():
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02
            t.add_(noise.abs() if "var" in name else noise)
    return module
