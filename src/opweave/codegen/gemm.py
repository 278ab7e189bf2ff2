"""Matrix products of two run-time operands pick their GEMM by measurement.

In a training step the weights are graph inputs, so nothing can be packed ahead of time
as the inference anchors are (codegen.library), and a weight gradient multiplies two
activations. torch's `mm` calls MKL's sgemm, which on these 2-core AMD machines ran
ViT's training GEMMs at 100-180 GFLOP/s; oneDNN's matmul on the same unpacked operands
(`mkldnn._linear_pointwise`, which computes `a @ w.T`) ran most of them at 170-215. Which
is faster depends on the shape and on which operand is a transposed view, and strides are
known only at run time, so the first product at each (shapes, strides, threads) runs both
on its actual operands, checks that they agree, and keeps the faster for the process.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import tune
from ..ir.graph import Node
from . import anchor_group, choice

_CHOICES: dict[tuple, Callable] = {}  # (shapes, strides, dtype, threads) -> the faster form


def _torch_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b)


def _onednn_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(a, b.t(), None, "none", [], "")


def applies(node: Node) -> bool:
    """A 2-D float32 product of two run-time values, on a torch built with oneDNN."""
    if node.op != "matmul" or not anchor_group.supports():
        return False
    return all(len(v.type.shape) == 2 and v.type.dtype == torch.float32
               and (v.producer is None or v.producer.op != "constant") for v in node.inputs)


KIND = "gemm-form"  # the tuning database's name for this decision
_FORMS = {"torch": _torch_mm, "onednn": _onednn_mm}


def measured_matmul(a: torch.Tensor, b: torch.Tensor, db: tune.TuningDB | None = None) -> torch.Tensor:
    """`a @ b` on the form recorded for this layout in `db` (the tuning database active
    when the step was compiled), or measured now and recorded there."""
    key = (tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), str(a.dtype),
           torch.get_num_threads())
    form = _CHOICES.get(key)
    if form is None:
        recalled = tune.recall(KIND, key, _FORMS, db)
        form = _CHOICES[key] = _FORMS[recalled[0]] if recalled else _choose(a, b, key, db)
    return form(a, b)


def chosen_forms() -> dict[tuple, str]:
    """What each measured layout chose (for reports and tests)."""
    return {key: form.__name__ for key, form in _CHOICES.items()}


def _choose(a: torch.Tensor, b: torch.Tensor, key=None, db=None, rounds: int = 7) -> Callable:
    """The faster of torch's and oneDNN's product on these operands: the minimum of
    interleaved runs after two warm-up rounds. oneDNN is kept only if it accepts the
    layout and agrees with torch (it is never trusted blindly with a new stride pattern)."""
    expected = torch.mm(a, b)
    try:
        got = _onednn_mm(a, b)
    except Exception:  # any refusal (a layout or dtype oneDNN does not take): torch's form
        return _torch_mm
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4,
                                                         atol=1e-5 * max(scale, 1.0)):
        return _torch_mm
    forms = tune.shortlist(KIND, key, _FORMS, db or tune.active()) if key else _FORMS
    samples = choice.measure(forms, (a, b), rounds)
    best = min(samples, key=lambda name: min(samples[name]))
    if key is not None:
        tune.remember(KIND, key, best, samples, db)
    return _FORMS[best]
