"""Attention picks its form by measurement: torch's fused CPU kernel, two batched
products with a softmax between ("unfused"), or each head's two products and softmax in
cache ("per-head", onednn_attention.cpp).

The fused kernel (`_scaled_dot_product_flash_attention_for_cpu`, the IR op's own form)
never holds the [seq, seq] scores, which is what long sequences need (Whisper's 1500
frames ran 4x slower unfused). At the lengths of BERT and ViT the scores fit in cache,
and the kernel's blocks ran at half the machine's float32 rate: one ViT-B/16 attention
(12 heads, 197 tokens) took 1.3 ms fused, 1.06 unfused and 0.88 per head; BERT-base's
(128 tokens) 0.47, 0.40 and 0.33 (2 Zen 4 threads). The per-head form runs oneDNN's
sgemm on one (batch, head) pair per thread at a time and the softmax on its scores while
they are in L2, and writes its head of the result in place: it allocates only its result
(and a buffer per thread, kept) and is one raw call in a native plan. Which wins depends
on the lengths and the machine, so each shape is measured once at compile time, on
operands laid out as models pass them (heads split from a product's output: a transposed
view), and the choice is kept in the tuning database (kind "attention-form") like every
measured one. A form must agree with the fused kernel first, on operands with a masked
key and a hidden row. A mask that is a constant of zeros (what export leaves for ViT) is dropped from every
form; a constant one that hides no row entirely spares the others their check for such
rows. Causal attention and boolean masks keep the fused kernel, and so do shapes whose
scores would exceed `UNFUSED_BYTES`. Under precision "bf16" the fused kernel on bf16
operands is one more form, and the per-head form on bf16 operands (oneDNN's bf16 matmul
where it has one here) another, measured beside the float32 ones (docs/precision.md).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Callable

import torch

from .. import tune
from ..ir.graph import Node
from ..ir.ops.linalg import _attention
from ..notices import warn_once
from . import choice, onednn_direct
from . import precision as prec

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


class PerHead:
    """The "per-head" form (onednn_attention.cpp): each (batch, head) pair's two products
    on oneDNN's sgemm, with the softmax on its scores while they are in cache, the pairs
    split over the thread team; the result laid out as `unfused` lays it out. One native
    object per layout of the operands (made at its first call with that layout). A call
    reports itself to a native plan's recorder like a generated kernel: output, query,
    key, value, the object's address as a constant int64 tensor, then the mask.
    `low`: query, key, value and result in bf16, each pair's products on oneDNN's bf16
    matmul, its scores, softmax and mask in float32 (the form "per-head-bf16")."""

    def __init__(self, scale: float, masked: bool, hidden_rows: bool, low: bool = False):
        self.scale, self.masked, self.hidden_rows = scale, masked, hidden_rows
        self.dtype = prec.LOW if low else torch.float32
        self._made: dict[tuple, torch.Tensor] = {}  # strides -> the object's address
        self._lock = threading.Lock()

    def _context(self, geometry: tuple[int, ...]) -> torch.Tensor:
        with self._lock:
            if geometry not in self._made:
                lib = onednn_direct.library()
                error = ctypes.create_string_buffer(256)
                flags = int(self.masked) | 2 * int(self.masked and self.hidden_rows) \
                    | 4 * int(self.dtype == prec.LOW)
                handle = lib.ow_attention_create((ctypes.c_int64 * len(geometry))(*geometry),
                                                 self.scale, flags, error, len(error))
                if not handle:
                    raise Refused(f"the per-head attention {geometry} was refused: "
                                  f"{error.value.decode(errors='replace')}")
                weakref.finalize(self, lib.ow_attention_destroy, handle)
                self._made[geometry] = torch.tensor([handle], dtype=torch.int64)
            return self._made[geometry]

    def __call__(self, q, k, v, mask=None):
        b, h, lq, d = q.shape
        lk, dv = k.shape[2], v.shape[3]
        if k.shape != (b, h, lk, d) or v.shape != (b, h, lk, dv):
            raise ValueError(f"per-head attention: query {tuple(q.shape)}, key "
                             f"{tuple(k.shape)} and value {tuple(v.shape)} do not fit")
        if self.masked and mask is None:
            raise ValueError("a masked per-head attention was called without its mask")
        given = [x.dtype for x in (q, k, v)] + ([mask.dtype] if self.masked else [])
        if given != [self.dtype] * 3 + [torch.float32] * self.masked:
            raise ValueError(f"per-head attention in {self.dtype} (a float32 mask): query, "
                             f"key, value{', mask' * self.masked} given in {given}")
        q, k, v = (_dense_rows(x) for x in (q, k, v))
        operands = [q, k, v]
        mask_strides = (0, 0, 0)
        if self.masked:  # (rows broadcast are read again: stride 0)
            mask = mask.expand(b, h, lq, lk)
            mask = mask if mask.stride(-1) == 1 or lk == 1 else mask.contiguous()
            operands.append(mask)
            mask_strides = mask.stride()[:3]
        geometry = (b, h, lq, lk, d, dv, *_strides(q), *_strides(k), *_strides(v), *mask_strides)
        context = self._context(geometry)
        out = torch.empty(b, lq, h, dv, dtype=self.dtype)
        onednn_direct.run_recorded(onednn_direct.library().ow_attention_run,
                                   [out, *operands[:3], context, *operands[3:]])
        return out.transpose(1, 2)


class Refused(RuntimeError):
    """oneDNN's module refused a per-head attention's native object (for its bf16 form:
    no bf16 products but the reference ones here)."""


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where sgemm can read its rows in place (the last dimension dense, rows
    no closer than their length), else a contiguous copy."""
    *_, rows, length = t.shape
    if (t.stride(-1) == 1 or length == 1) and (t.stride(-2) >= length or rows == 1):
        return t
    return t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The strides of batch, head and row that sgemm is given: a single row's stride is
    never read (torch leaves it anything, even less than the row's length), so its
    length stands in for it."""
    batch, head, row = t.stride()[:3]
    return batch, head, row if t.shape[2] > 1 else max(row, t.shape[3])


def per_head_problem() -> str | None:
    """Why the per-head form is not offered here (oneDNN's module is unavailable), or
    None."""
    return None if onednn_direct.library() is not None else onednn_direct.unavailable()


FORMS = ("fused", "unfused", "per-head")  # `_bound` makes each one's call
# under precision "bf16" also the fused kernel on bf16 operands (the policy's own form)
# and the per-head form on them; where a float32 form measures faster, the attention
# computes in float32 (only more accurate), as a library group does
LOW_FORM = "fused-bf16"
LOW_PER_HEAD = "per-head-bf16"
LOW_FORMS = (LOW_FORM, LOW_PER_HEAD)
LOW_TOLERANCE = 3e-2  # their agreement with the float32 kernel, relative and absolute


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


def _offered(node: Node, precision: str = "fp32") -> tuple[str, ...]:
    """The forms compared for this node here: the per-head form where oneDNN's module is
    available and query, key and value share their batch and heads; under precision
    "bf16" LOW_FORM, and LOW_PER_HEAD where the per-head form is offered and oneDNN's
    own library has bf16 products on this CPU."""
    q, k, v = (x.type.shape for x in node.inputs[:3])
    fits = q[:2] == k[:2] == v[:2] and k[2] == v[2] and q[3] == k[3]
    per_head = fits and per_head_problem() is None
    forms = FORMS if per_head else FORMS[:2]
    if not prec.applies(precision, node.op):
        return forms
    low_per_head = per_head and onednn_direct.bf16_problem() is None
    return forms + (LOW_FORMS if low_per_head else (LOW_FORM,))


def _key(node: Node, mask: Mask, precision: str = "fp32") -> tuple:
    # (a negative scale makes the fused kernel negate the query first)
    return (tuple(str(x.type) for x in node.inputs[:3]), mask.type, mask.hidden_rows,
            node.attrs["scale"] < 0, torch.get_num_threads(), _offered(node, precision))


_CHOICES: dict[tuple, str] = {}  # key -> the form chosen in this process


def _examples(node: Node, mask: Mask) -> list[torch.Tensor]:
    """Random operands of the node's shapes: query, key and value as heads split from a
    [batch, seq, heads, dim] product output (a transposed view); the mask random, with
    its first key hidden, and the whole of its first row where it has rows, or of its
    first sequence where it has batches but no rows (so that the forms are compared on a
    row the mask hides entirely too)."""
    args = []
    for x in node.inputs[:3]:
        b, h, s, d = x.type.shape
        args.append(torch.randn(b, s, h, d).transpose(1, 2))
    if not mask.dropped:
        additive = torch.randn(node.inputs[3].type.shape)
        additive[..., 0] = float("-inf")
        if mask.hidden_rows and additive.dim() >= 2 and additive.shape[-2] > 1:
            additive[..., 0, :] = float("-inf")
        elif mask.hidden_rows and additive.dim() == 4 and additive.shape[0] > 1:
            additive[0] = float("-inf")  # [batch, 1, 1, keys]: a sequence hidden entirely
        args.append(additive)
    return args


def choose(node: Node, db: tune.TuningDB | None = None, mask: Mask | None = None,
           rounds: int = 7, precision: str = "fp32") -> str:
    """The faster form for this attention here: recorded in the tuning database for this
    machine, or measured now (interleaved runs after two warm-up rounds, the minimum) and
    recorded; within `choice.rechecking`, measured again and decided on the record's
    samples and the new ones together. A form must agree with the fused kernel first
    (LOW_FORM, that kernel on bf16 operands, within bf16's rounding)."""
    mask = mask or Mask(node, None)
    key = _key(node, mask, precision)
    if key in _CHOICES:
        return _CHOICES[key]
    recheck = choice.is_rechecking()
    offered = _offered(node, precision)
    recalled = None if recheck else tune.recall(KIND, key, offered, db)
    if recalled is not None:
        _CHOICES[key] = recalled[0]
        return recalled[0]
    args = _examples(node, mask)
    forms = {name: _bound(name, node, mask) for name in offered}
    expected = forms["fused"](*args)
    size = max(float(torch.nan_to_num(expected.abs(), nan=0.0, posinf=0.0).max()), 1.0)
    for name in offered[1:]:  # a form must agree with the fused kernel to be measured
        try:
            got = forms[name](*args)
        except Refused as err:  # its native object was refused: not offered here
            warn_once(f"opweave: attention's form {name!r} is not offered here: {err}",
                      onednn_direct.OneDNNWarning)
            del forms[name]
            continue
        # (the bf16 forms within bf16's rounding of their operands: a few parts in 1000)
        tolerance = (LOW_TOLERANCE, LOW_TOLERANCE * size) if name in LOW_FORMS else \
            (1e-4, 1e-5 * size)
        if not torch.allclose(got, expected, *tolerance, equal_nan=True):
            del forms[name]
    if len(forms) == 1:
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
    if name == "per-head":
        return PerHead(scale, not mask.dropped, mask.hidden_rows)
    if name in LOW_FORMS:
        return _OnBf16(_low_form(name, scale, mask))
    return lambda q, k, v, *m: _attention(q, k, v, *m, scale=scale, causal=False)


class _OnBf16:
    """A bf16 form as `choose` calls it, measured on operands already in bf16: in a model
    the products before it hand them on so (`precision.hand_off_in_bf16`), so timing their
    rounding here would charge it for conversions it does not make."""

    def __init__(self, form: prec.LowPrecisionCall):
        self._form = form

    def __call__(self, *args):
        return self._form(*args)[0]

    def measured_args(self, args: list) -> list:
        return self._form.operands(args)


def _low_form(name: str, scale: float, mask: Mask) -> prec.LowPrecisionCall:
    """The bf16 form `name` as a step function: its result widened to float32 unless only
    bf16 steps read it. The fused kernel reads its mask rounded to bf16 too (as torch's
    autocast gives it); the per-head form reads it in float32, which keeps a mask of
    float32's lowest value finite and a large bias exact."""
    if name == LOW_PER_HEAD:
        form = PerHead(scale, not mask.dropped, mask.hidden_rows, low=True)
        # (a mask another bf16 step handed on in bf16 is widened back)
        return prec.LowPrecisionCall(
            lambda q, k, v, *m: [form(q, k, v, *(prec.widen(x) for x in m))], narrowed=3)
    return prec.LowPrecisionCall(
        lambda q, k, v, *m: [_attention(q, k, v, *m, scale=scale, causal=False)])


def measured(node: Node, db: tune.TuningDB | None = None,
             constant_mask: torch.Tensor | None = None,
             precision: str = "fp32") -> tuple[str, Callable, int]:
    """(the chosen form's name, a step function: its inputs in, [output] out, and how
    many of the node's inputs it takes: 3 where the mask is dropped). `constant_mask`:
    the mask's value where it is a constant of the graph."""
    mask = Mask(node, constant_mask)
    name = choose(node, db, mask, precision=precision)
    reads = 3 if mask.dropped else len(node.inputs)
    if name in LOW_FORMS:
        return name, _low_form(name, node.attrs["scale"], mask), reads
    form = _bound(name, node, mask)
    return name, lambda *args: [form(*args)], reads

