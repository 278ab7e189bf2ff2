"""Attention picks its form by measurement: torch's fused CPU kernel, or two batched
products with a softmax between.

The fused kernel (`_scaled_dot_product_flash_attention_for_cpu`, the IR op's own form)
never holds the [seq, seq] scores, which is what long sequences need (Whisper's 1500
frames ran 4x slower unfused). At the lengths of BERT and ViT the scores fit in cache,
and the kernel's blocks ran at half the machine's float32 rate: one ViT-B/16 attention
(12 heads, 197 tokens) took 1.0-1.3 ms fused against 0.9 unfused, BERT-base's (128
tokens) 0.45-0.6 against 0.37 (2 Zen 4 threads). Which wins depends on the lengths and
the machine, so each shape is measured once at compile time, on operands laid out as
models pass them (heads split from a product's output: a transposed view), and the
choice is kept in the tuning database (kind "attention-form") like every measured one.
Causal attention and boolean masks keep the fused kernel, and so do shapes whose scores
would exceed `UNFUSED_BYTES`.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import tune
from ..ir.graph import Node
from ..ir.ops.linalg import _attention
from . import library

KIND = "attention-form"  # the tuning database's name for this decision
UNFUSED_BYTES = 16 << 20  # the largest [batch, heads, seq, seq] scores the unfused form holds


def unfused(q, k, v, mask=None, *, scale: float, causal: bool = False):
    """softmax(scale * q k^T + mask) v as two batched products and a softmax (an additive
    mask broadcast over the scores). For a batch of 1 the heads of a transposed view are
    read in place."""
    if causal:
        raise ValueError("the unfused attention form takes no causal mask")
    b, h, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[3]
    scores = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).mul_(scale)
    if mask is not None:
        scores.view(b, h, lq, lk).add_(mask)
    return torch.bmm(torch.softmax(scores, dim=-1), v.flatten(0, 1)).view(b, h, lq, dv)


FORMS: dict[str, Callable] = {"fused": _attention, "unfused": unfused}


def applies(node: Node) -> bool:
    """A float32 attention without a causal mask, with no mask or an additive float32
    one, whose scores fit within UNFUSED_BYTES."""
    if node.op != "attention" or node.attrs.get("causal"):
        return False
    q, k, v = (x.type for x in node.inputs[:3])
    if any(t.dtype != torch.float32 or len(t.shape) != 4 or 0 in t.shape for t in (q, k, v)):
        return False
    if len(node.inputs) == 4 and node.inputs[3].type.dtype != torch.float32:
        return False
    return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= UNFUSED_BYTES


def _key(node: Node) -> tuple:
    mask = str(node.inputs[3].type) if len(node.inputs) == 4 else None
    return (tuple(str(x.type) for x in node.inputs[:3]), mask, torch.get_num_threads())


def _examples(node: Node) -> list[torch.Tensor]:
    """Random operands of the node's shapes: query, key and value as heads split from a
    [batch, seq, heads, dim] product output (a transposed view), the mask as it is."""
    args = []
    for x in node.inputs[:3]:
        b, h, s, d = x.type.shape
        args.append(torch.randn(b, s, h, d).transpose(1, 2))
    if len(node.inputs) == 4:
        args.append(torch.randn(node.inputs[3].type.shape))
    return args


def choose(node: Node, db: tune.TuningDB | None = None, rounds: int = 7) -> str:
    """The faster form for this attention here: recorded in the tuning database for this
    machine, or measured now (interleaved runs after two warm-up rounds, the minimum) and
    recorded. The unfused form must agree with the fused one first."""
    key = _key(node)
    recalled = tune.recall(KIND, key, FORMS, db)
    if recalled is not None:
        return recalled[0]
    scale = node.attrs["scale"]
    args = _examples(node)
    forms = {name: _bound(form, scale) for name, form in FORMS.items()}
    expected, got = forms["fused"](*args), forms["unfused"](*args)
    size = max(float(expected.abs().max()), 1.0)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * size):
        return "fused"
    samples = library.measure(forms, args, rounds)
    best = min(samples, key=lambda name: min(samples[name]))
    tune.remember(KIND, key, best, samples, db)
    return best


def _bound(form: Callable, scale: float) -> Callable:
    return lambda q, k, v, *mask: form(q, k, v, *mask, scale=scale, causal=False)


def measured(node: Node, db: tune.TuningDB | None = None) -> tuple[str, Callable]:
    """(the chosen form's name, a step function: the node's inputs in, [output] out)."""
    name = choose(node, db)
    form = _bound(FORMS[name], node.attrs["scale"])
    return name, lambda *args: [form(*args)]

