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
A mask that is a constant of zeros (what export leaves for ViT) is dropped from either
form; a constant one that hides no row entirely spares the unfused form its check for
such rows. Causal attention and boolean masks keep the fused kernel, and so do shapes
whose scores would exceed `UNFUSED_BYTES`.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import tune
from ..ir.graph import Node
from ..ir.ops.linalg import _attention
from . import choice

KIND = "attention-form"  # the tuning database's name for this decision
# the largest [batch, heads, seq, seq] scores the unfused form holds (with its softmax's
# result, twice this at its peak)
UNFUSED_BYTES = 16 << 20


def unfused(q, k, v, mask=None, *, scale: float, causal: bool = False,
            hidden_rows: bool = True):
    """softmax(scale * q k^T + mask) v as two batched products and a softmax (an additive
    mask broadcast over the scores), equal to the fused kernel's result:
    - a row the mask hides entirely (all -inf) is 0, not softmax's NaN;
    - the result is laid out [batch, seq, heads, dim] in memory, as the kernel's is, so
      that merging the heads after it (a transpose and reshape) copies nothing: its copy
      is here, where measuring the form counts it.
    For a batch of 1 the heads of a transposed view are read in place. `hidden_rows=False`
    (a constant mask known to hide no row entirely) skips looking for such rows."""
    if causal:
        raise ValueError("the unfused attention form takes no causal mask")
    b, h, lq, _ = q.shape
    lk, dv = k.shape[2], v.shape[3]
    scores = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).mul_(scale)
    if mask is not None:
        scores.view(b, h, lq, lk).add_(mask)
    probabilities = torch.softmax(scores, dim=-1)
    if mask is not None and hidden_rows:
        hidden = scores.amax(dim=-1, keepdim=True) == float("-inf")
        probabilities.masked_fill_(hidden, 0.0)
    out = torch.bmm(probabilities, v.flatten(0, 1)).view(b, h, lq, dv)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


FORMS = ("fused", "unfused")  # `_bound` makes each one's call


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


class Mask:
    """What is known of an attention's mask at compile time: `dropped` (none, or a
    constant of zeros, which adds nothing) and `hidden_rows` (whether a row may be hidden
    entirely: a mask given at run time may; a constant one is looked at)."""

    def __init__(self, node: Node, constant: torch.Tensor | None):
        given = len(node.inputs) == 4
        self.dropped = not given or (constant is not None and not constant.any())
        self.hidden_rows = given and not self.dropped and (
            constant is None or bool((constant == float("-inf")).all(dim=-1).any()))
        self.type = None if self.dropped else str(node.inputs[3].type)


def _key(node: Node, mask: Mask) -> tuple:
    # (a negative scale makes the fused kernel negate the query first)
    return (tuple(str(x.type) for x in node.inputs[:3]), mask.type, mask.hidden_rows,
            node.attrs["scale"] < 0, torch.get_num_threads())


_CHOICES: dict[tuple, str] = {}  # key -> the form chosen in this process


def _examples(node: Node, mask: Mask) -> list[torch.Tensor]:
    """Random operands of the node's shapes: query, key and value as heads split from a
    [batch, seq, heads, dim] product output (a transposed view); the mask random, with
    its first key hidden, and the whole of its first row where it has rows (so that the
    two forms are compared on a row the mask hides entirely too)."""
    args = []
    for x in node.inputs[:3]:
        b, h, s, d = x.type.shape
        args.append(torch.randn(b, s, h, d).transpose(1, 2))
    if not mask.dropped:
        additive = torch.randn(node.inputs[3].type.shape)
        additive[..., 0] = float("-inf")
        if mask.hidden_rows and additive.dim() >= 2 and additive.shape[-2] > 1:
            additive[..., 0, :] = float("-inf")
        args.append(additive)
    return args


def choose(node: Node, db: tune.TuningDB | None = None, mask: Mask | None = None,
           rounds: int = 7) -> str:
    """The faster form for this attention here: recorded in the tuning database for this
    machine, or measured now (interleaved runs after two warm-up rounds, the minimum) and
    recorded; within `choice.rechecking`, measured again and decided on the record's
    samples and the new ones together. The unfused form must agree with the fused one
    first."""
    mask = mask or Mask(node, None)
    key = _key(node, mask)
    if key in _CHOICES:
        return _CHOICES[key]
    recheck = choice.is_rechecking()
    recalled = None if recheck else tune.recall(KIND, key, FORMS, db)
    if recalled is not None:
        _CHOICES[key] = recalled[0]
        return recalled[0]
    args = _examples(node, mask)
    forms = {name: _bound(name, node, mask) for name in FORMS}
    expected, got = forms["fused"](*args), forms["unfused"](*args)
    size = max(float(expected.abs().max()), 1.0)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5 * size):
        _CHOICES[key] = "fused"
        return "fused"
    samples = choice.measure(forms, args, rounds)
    if recheck:  # decided on the record's samples and today's together, as library forms
        earlier = tune.recorded_samples(KIND, key, db)
        samples = {name: earlier.get(name, []) + times for name, times in samples.items()}
    best = _CHOICES[key] = min(samples, key=lambda name: min(samples[name]))
    tune.remember(KIND, key, best, samples, db)
    return best


def _bound(name: str, node: Node, mask: Mask) -> Callable:
    """The form `name` called on query, key, value and the mask unless it is dropped."""
    scale = node.attrs["scale"]
    if name == "unfused":
        hidden_rows = mask.hidden_rows
        return lambda q, k, v, *m: unfused(q, k, v, *m, scale=scale, hidden_rows=hidden_rows)
    return lambda q, k, v, *m: _attention(q, k, v, *m, scale=scale, causal=False)


def measured(node: Node, db: tune.TuningDB | None = None,
             constant_mask: torch.Tensor | None = None) -> tuple[str, Callable, int]:
    """(the chosen form's name, a step function: its inputs in, [output] out, and how
    many of the node's inputs it takes: 3 where the mask is dropped). `constant_mask`:
    the mask's value where it is a constant of the graph."""
    mask = Mask(node, constant_mask)
    name = choose(node, db, mask)
    form = _bound(name, node, mask)
    return name, lambda *args: [form(*args)], 3 if mask.dropped else len(node.inputs)

