"""The precision policy: which steps compute in bfloat16, and how (`Options.precision`).

"fp32" (the default) computes everything in float32. "bf16": matrix products,
convolutions (transposed ones too) and attention read their operands rounded to bfloat16
and accumulate in float32 (oneDNN's bf16 primitives, with weights stored in bf16 at
compile time, but for a transposed convolution, a single op rounded at each call; for
attention torch's bf16 flash-attention kernel or the per-head form on oneDNN's bf16
matmul, both keeping the softmax in float32). The step's result, with
its fused epilogue (bias, activation, a convolution's residual add; a product's residual
add runs after it, in float32), is rounded to bfloat16 once: widened
back to float32 for the steps that compute in float32, handed on as it is where only
bf16 steps read it. Every other op (norms, softmax outside attention, reductions,
pointwise kernels) computes in float32 as before, and graph inputs and outputs stay
float32. A bf16 result also passes on in bf16 through steps that only move or pick
elements (`passes_bf16`: views, cat, max pooling), into a layer norm that reads it
in float32 arithmetic (`MixedCall`), and into a fused generated kernel, which widens it
in registers and writes its own results rounded to bf16 where only bf16 steps read them
(its bf16 form: `render(..., low=)`); either way the values are those of the widened
copies, to the bit. A library group or attention is measured in both
types, and keeps float32 (only more accurate) where a float32 form measured clearly
faster than its bf16 forms (`choice._preferring_bf16`); `explain` counts the bf16 steps.

"bf16x3" (Henry, Tang and Heinecke, ARITH'19) keeps float32's accuracy: a linear layer
or convolution with a constant weight may compute from three bf16 parts of each operand,
the six largest of their cross products summed in float32 (oneDNN's bf16 primitive over a
six times longer reduction: codegen/onednn_direct.cpp). Six bf16 products pay only where
bf16 runs more than six times float32's rate (AMX tiles), so whether a group splits is
measured against its float32 forms at its shapes; everything else computes in float32.

On a CPU without AVX-512 (AVX2 only) torch's oneDNN refuses bf16 (`bf16_supported`), so
"bf16" computes in float32 there, said once; oneDNN 3.2 (the library "bf16x3" and the
direct bf16 form run on) has no bf16 primitives either, and bf16x3 computes in float32,
said once too. `units()` says which bf16 units this CPU has.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from ..ir.graph import Value
from ..ir.types import TensorType

from .render import FUSIBLE

LOWERED_OPS = frozenset({"matmul", "conv", "conv_transpose", "attention"})
LOW = torch.bfloat16
# ends the name of a measured form that computes on bfloat16 operands ("onednn-direct-bf16",
# attention's "per-head-bf16"), beside the float32 forms it is measured against
LOW_SUFFIX = "-bf16"


def narrow(t):
    """A float32 tensor rounded to bfloat16; anything else as it is."""
    return t.to(LOW) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def widen(t: torch.Tensor) -> torch.Tensor:
    """A bfloat16 result back in float32 (the graph's type); anything else as it is."""
    return t.float() if t.dtype == LOW else t


class LowPrecisionCall:
    """A step's function (tensors in, a list of tensors out) computed on bfloat16 operands
    (float32 ones are rounded; bf16 ones pass as they are): all its arguments, or its first
    `narrowed` (an attention's mask may stay float32). Its results are widened back to
    float32, except those at the positions in `keep_low`: outputs that only bf16 steps
    read, which `hand_off_in_bf16` leaves in bf16 to save a conversion each way."""

    def __init__(self, fn: Callable, narrowed: int | None = None):
        self.fn, self.narrowed = fn, narrowed
        self.keep_low: frozenset[int] = frozenset()

    def operands(self, args) -> list:
        """`args` as `fn` reads them: the float32 ones it takes in bf16 rounded."""
        count = len(args) if self.narrowed is None else self.narrowed
        return [narrow(a) if i < count else a for i, a in enumerate(args)]

    def __call__(self, *args):
        outs = self.fn(*self.operands(args))
        return [y if i in self.keep_low else widen(y) for i, y in enumerate(outs)]

    def handed_on(self) -> Callable:
        """The call with every result left in bf16, as `hand_off_in_bf16` leaves it for
        readers that round it (how a group whose result may leave in bf16 is measured:
        `choice.leaving_bf16`)."""
        return lambda *args: self.fn(*self.operands(args))


# ops that compute in float32 and may read a bf16 operand as it is: torch's kernel widens
# it in registers (exactly, as `widen` does) and accumulates in float32 (its mixed-dtype
# layer norm: 27 against 54 us for widen + norm + round at BERT-base's [128, 768] on the
# Zen 4, 38 against 87 at ViT's [197, 768])
MIXED_OPS = frozenset({"layer_norm"})


class MixedCall:
    """A float32 op (`MIXED_OPS`) whose first operand may arrive in bfloat16, handed on by a
    bf16 step: it computes on it in float32 without a widened copy. Its results at the
    positions in `keep_low` (outputs that only bf16 steps read, which would round them
    anyway: `hand_off_in_bf16`) come out rounded to bfloat16, the others float32. torch's
    mixed-dtype kernel (its CPU kernel; elsewhere the operand is widened) rounds its first
    output itself, so a bf16 operand whose result is wanted in float32 is widened first."""

    reads_low = frozenset({0})  # the operand positions that may arrive in bf16

    def __init__(self, fn: Callable):
        self.fn = fn
        self.keep_low: frozenset[int] = frozenset()

    def __call__(self, x, *rest):
        if x.dtype == LOW and (0 not in self.keep_low or x.device.type != "cpu"):
            x = widen(x)
        outs = self.fn(x, *rest)
        return [narrow(y) if i in self.keep_low else widen(y) for i, y in enumerate(outs)]


def low_precision_call(step) -> LowPrecisionCall | None:
    """The step's bf16 call, if it computes in bf16 (a library form may sit behind a
    wrapper that passes it its leading inputs, as `form`)."""
    fn = getattr(step.fn, "form", step.fn)
    return fn if isinstance(fn, LowPrecisionCall) else None


# single ops that compute on bf16 operands exactly what they compute on the widened ones,
# rounded (they only move or pick elements), besides views
PASSING_OPS = frozenset({"cat"})


def passes_bf16(step) -> bool:
    """Whether `step` hands a bf16 operand on as bf16, computing on it what it computes on
    the widened one, rounded, by only moving or picking elements: a single view op or
    `PASSING_OPS` op (torch takes any dtype), or a template kernel with bf16 variants
    (`CppKernel.passes_bf16`: max pooling)."""
    if step.kind == "op" and len(step.nodes) == 1:
        node = step.nodes[0]
        return node.opdef.is_view or node.op in PASSING_OPS
    return getattr(step.fn, "passes_bf16", False)


def _is_view(step) -> bool:
    """Whether `step` is one view op."""
    return step.kind == "op" and len(step.nodes) == 1 and step.nodes[0].opdef.is_view


def has_bf16_forms(step) -> bool:
    """Whether `step` is a fused generated kernel, which reads any operand in bf16 as it
    comes (widened in registers, exactly) and writes any result in bf16 (rounded) in a
    form made for it (`render(..., low=)`, lower._build_bf16_forms)."""
    return step.kind == "cpp" and getattr(step.fn, "rerender", None) is not None


# ops that end a bf16 group's epilogue (bias, activation, residual add): the group's
# result, bf16, is theirs
_EPILOGUE_OPS = frozenset({"add", "relu", "gelu", "tanh", "sigmoid", "clamp"})
# poolings whose generated kernels have bf16 forms (codegen/templates.py)
POOLING_OPS = frozenset({"max_pool2d", "adaptive_max_pool2d"})
# ops that, alone in a step, take a bf16 operand as it comes and may hand bf16 on
_TAKES_BF16 = PASSING_OPS | MIXED_OPS | POOLING_OPS


def may_arrive_in_bf16(v, graph_outputs=frozenset(), depth: int = 4,
                       from_norms: bool = True) -> bool:
    """Whether a bf16 step's operand `v` may come to it in bf16: it is made by a product,
    convolution or attention (a step that may compute in bf16) or by the epilogue of one,
    or by a layer norm (`MixedCall` rounds its result for readers that round), directly or
    through ops that pass bf16 on (views, cat, poolings with bf16 kernels); and neither it
    nor a value on that path is a graph output, which stays float32. Structural, so a
    choice it informs does not depend on what was chosen for the producer, and a "may":
    the producer may compute in float32 after all, or be fused into a float32 kernel.
    BERT's and ViT's products and ResNet-50's convolutions but its stem read such
    results; GCN's products read its input features and its sparse product's result,
    which are float32, so a bf16 form must round them at every call. `from_norms=False`
    leaves the norms out: one writes bf16 only where every reader rounds it, float32
    (as cheaply) for any other."""
    if v in graph_outputs:
        return False
    p = v.producer
    while p is not None and p.opdef.is_view and p.inputs:
        v = p.inputs[0]
        if v in graph_outputs:
            return False
        p = v.producer
    if p is None:  # a graph input
        return False
    if p.op in LOWERED_OPS or (from_norms and p.op in MIXED_OPS):
        return True
    if depth == 0:
        return False
    if p.op not in _EPILOGUE_OPS | PASSING_OPS | POOLING_OPS:
        # a pointwise function of one tensor (SiLU: x * sigmoid(x)) between bf16 steps: a
        # generated kernel that writes its result in bf16 for them (its bf16 form)
        source = _pointwise_source(v, graph_outputs)
        return source is not None and may_arrive_in_bf16(source, graph_outputs, depth - 1,
                                                         from_norms=False)
    return any(may_arrive_in_bf16(u, graph_outputs, depth - 1, from_norms) for u in p.inputs)


# the ops of a pointwise kernel's formula (what the generated kernels compute one to one)
_POINTWISE_OPS = FUSIBLE.pointwise


def _constant(v) -> bool:
    """Whether `v` is a constant, or a view of one (a per-channel scale as [1, C, 1, 1])."""
    p = v.producer
    while p is not None and p.opdef.is_view and p.inputs:
        p = p.inputs[0].producer
    return p is not None and p.op == "constant"


def _pointwise_source(v, graph_outputs, limit: int = 8):
    """The one tensor `v` is a pointwise function of (constants aside), through at most
    `limit` pointwise ops of its shape, none a graph output; None if not one."""
    sources, seen, todo = set(), set(), [v]
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        p = u.producer
        if _constant(u):
            continue
        if u is not v and (p is None or p.op not in _POINTWISE_OPS or u in graph_outputs
                           or u.type.shape != v.type.shape or len(seen) > limit):
            sources.add(u)
            continue
        if p is None or p.op not in _POINTWISE_OPS:
            return None
        todo.extend(p.inputs)
    return next(iter(sources)) if len(sources) == 1 else None


def read_in_bf16(v, users) -> bool:
    """Whether a product, convolution or attention reads `v`, directly or through views
    and cat (`users`: value -> the nodes reading it): a bf16 step would round it."""
    for u in users.get(v, ()):
        if u.op in LOWERED_OPS:
            return True
        if (u.opdef.is_view or u.op in PASSING_OPS) and \
                any(read_in_bf16(o, users) for o in u.outputs):
            return True
    return False


def may_leave_in_bf16(v, users, graph_outputs=frozenset(), depth: int = 4) -> bool:
    """Whether a bf16 step's result `v` may go to its readers in bf16, as
    `hand_off_in_bf16` leaves it: every reader takes it so, directly or through views, cat
    and poolings with bf16 kernels (`users`: value -> the nodes reading it). A product,
    convolution or attention rounds it; a layer norm (`MixedCall`) and a pointwise op (a
    generated kernel's bf16 form, or the epilogue of a group that adds it as its residual)
    widen it exactly; a graph output stays float32. Structural, as `may_arrive_in_bf16`:
    a "may", since a reader may still compute in float32. ResNet-50's convolutions but the
    last (read by the mean), BERT's and ViT's products (read by attention, the next
    product, GELU or a layer norm) are such."""
    readers = users.get(v, ())
    if v in graph_outputs or not readers:
        return False
    for u in readers:
        if u.op in LOWERED_OPS or u.op in _POINTWISE_OPS or \
                (u.op in MIXED_OPS and u.inputs[0] is v and v not in u.inputs[1:]):
            continue
        if depth > 0 and (u.opdef.is_view or u.op in PASSING_OPS or u.op in POOLING_OPS) \
                and all(may_leave_in_bf16(o, users, graph_outputs, depth - 1) for o in u.outputs):
            continue
        return False
    return True


def _only_read_in_bf16(v, users) -> bool:
    """Whether every reader of `v` is a product, convolution or attention, directly or
    through views and cat: all of them would round it."""
    readers = users.get(v, ())
    return bool(readers) and all(
        u.op in LOWERED_OPS or ((u.opdef.is_view or u.op in PASSING_OPS)
                                and all(_only_read_in_bf16(o, users) for o in u.outputs))
        for u in readers)


def conversion_bytes(ctx, members) -> int:
    """The bytes a group computing in float32 makes the bf16 steps around it convert: each
    value it reads that may arrive in bf16 is widened for it, and each value it writes
    that a bf16 step reads is rounded again (2 bytes read and 4 written, or 4 and 2, an
    element); a norm's result is not widened (it writes float32 for such a reader). Zero
    for a group with a product, convolution or attention (measured in bf16 with its
    conversions), and for one op that takes bf16 as it comes (a view, cat, a pooling with
    bf16 kernels, a layer norm: `MixedCall`). A fused kernel (a group of several ops)
    reads bf16 as it comes and writes bf16 for readers that all round (its bf16 form);
    a result that bf16 and float32 steps both read it writes once more, rounded (2 bytes
    an element: `bf16_twins`). The
    partitioner adds their time (`partition(..., conversion_seconds=...)`): it would
    otherwise see a float32 kernel between bf16 steps as free of them, and noise chose
    between BERT-base's FFN output with its residual add in the product's epilogue and
    the norm alone (55.6 ms a call in bf16, Zen 4) and the add and the norm as one
    float32 kernel (55.9)."""
    if any(n.op in LOWERED_OPS for n in members):
        return 0
    if len(members) == 1:
        (node,) = members
        if node.opdef.is_view or node.op in _TAKES_BF16:
            return 0
    inputs = {v for n in members for v in n.inputs if not ctx.producer_in(v, members)}
    outputs = {v for n in members for v in n.outputs if ctx.escapes(v, members)}
    rounded = sum(v.type.nbytes for v in outputs if v.type.dtype == torch.float32
                  and v not in ctx.graph_outputs and read_in_bf16(v, ctx.users)
                  and (len(members) == 1 or not _only_read_in_bf16(v, ctx.users)))
    if len(members) > 1:
        return rounded // 2
    widened = sum(v.type.nbytes for v in inputs if v.type.dtype == torch.float32
                  and may_arrive_in_bf16(v, ctx.graph_outputs, from_norms=False))
    return (widened + rounded) * 3 // 2


def fused_bytes(ctx, v, members) -> int:
    """The bytes a fused kernel (a group of several ops without a product) moves for a
    value `v` it reads or writes under bf16: half its float32 size for a result of a bf16
    step it reads as it comes, and for a result it writes for bf16 steps only (its bf16
    form); the type's size for anything else. Counted so, the partitioner sees that
    ViT-B/16's residual add and layer norm as one kernel move 1.8 MB, not 2.4."""
    size = v.type.nbytes
    if v.type.dtype != torch.float32 or v in ctx.graph_outputs \
            or any(n.op in LOWERED_OPS for n in members):
        return size
    if ctx.producer_in(v, members):  # a result it writes
        return size // 2 if _only_read_in_bf16(v, ctx.users) else size
    return size // 2 if may_arrive_in_bf16(v, ctx.graph_outputs, from_norms=False) else size


def _readers(steps) -> dict:
    """value -> the steps that read it (each once)."""
    readers: dict = {}
    for step in steps:
        for v in dict.fromkeys(step.inputs):
            readers.setdefault(v, []).append(step)
    return readers


def _handing_call(step):
    """What holds the `keep_low` of `step`'s results: its `MixedCall`, fused kernel or
    bf16 call; None for a step that hands nothing on in bf16 of its own."""
    if isinstance(step.fn, MixedCall) or has_bf16_forms(step):
        return step.fn
    return low_precision_call(step)


def hand_off_in_bf16(steps, graph_outputs) -> int:
    """Leave a step's output in bf16 where its readers would round it to bf16 anyway: every
    step that reads it, directly or through steps that pass bf16 on exactly
    (`passes_bf16`: views, concatenation, max pooling), computes in bf16 itself. A bf16
    step's output (rounded already) may also go to a step that widens it exactly: a
    `MixedCall` at an operand it reads in bf16, or a fused generated kernel
    (`has_bf16_forms`) at any operand. The results of a `MixedCall` or a fused kernel
    (float32 arithmetic) are rounded only for readers that round them: for another norm
    or kernel it would be a rounding that was not there. Graph outputs stay float32.
    Returns the number of outputs handed off."""
    readers = _readers(steps)
    outputs = set(graph_outputs)

    def rounded_by_readers(v, widening_too: bool) -> bool:
        if v in outputs or not readers.get(v):
            return False
        for r in readers[v]:
            if r.precision == "bf16" and low_precision_call(r) is not None:
                continue
            if widening_too and has_bf16_forms(r):
                continue
            if passes_bf16(r):
                if all(rounded_by_readers(o, widening_too) for o in r.outputs):
                    continue
                return False
            if not (widening_too and isinstance(r.fn, MixedCall) and all(
                    i in r.fn.reads_low for i, u in enumerate(r.inputs) if u is v)):
                return False
        return True

    handed = 0
    for step in steps:
        call = _handing_call(step)
        if call is None:
            continue
        # float32 arithmetic (a norm's, a kernel's): rounded only for readers that round
        computed = isinstance(call, MixedCall) or has_bf16_forms(step)
        call.keep_low = frozenset(i for i, v in enumerate(step.outputs)
                                  if rounded_by_readers(v, widening_too=not computed))
        handed += len(call.keep_low)
    return handed


def bf16_kernel_operands(steps) -> list[tuple[object, list[int]]]:
    """(step, positions of its operands that come in bf16) for each fused generated kernel
    (`has_bf16_forms`), once `hand_off_in_bf16` has decided: an operand is a result
    handed on in bf16 (`keep_low`), directly or through steps that pass bf16 on
    (`passes_bf16`: a view or a max pooling keeps its operand's type, a cat the type
    all its operands share)."""
    low: set = set()
    found = []
    for step in steps:
        if has_bf16_forms(step):
            found.append((step, [i for i, v in enumerate(step.inputs) if v in low]))
        if passes_bf16(step):
            joined = step.kind == "op" and step.nodes[0].op in PASSING_OPS
            if step.inputs and (all(v in low for v in step.inputs) if joined
                                else step.inputs[0] in low):
                low.update(step.outputs)
            continue
        call = _handing_call(step)
        if call is not None:
            low.update(step.outputs[i] for i in call.keep_low)
    return found


def _rounds(step, v) -> bool:
    """Whether `step` computes in bf16 on `v` (rounds it at every place it reads it)."""
    call = low_precision_call(step)
    if step.precision != "bf16" or call is None:
        return False
    count = len(step.inputs) if call.narrowed is None else call.narrowed
    return all(i < count for i, u in enumerate(step.inputs) if u is v)


@dataclass
class Twin:
    """A fused kernel's float32 result (`source`) also written rounded to bf16 into
    `value`, for the bf16 steps that read it (`readers`) and through views whose results
    only bf16 steps read (`views`, each with its readers): they round it themselves
    otherwise, in a copy a call (BERT-base's 24 norms: about 2% of its time)."""
    source: Value
    value: Value
    readers: list = field(default_factory=list)
    views: list = field(default_factory=list)  # (view step, the steps reading its result)

    def rewire(self, steps: list) -> None:
        """Point the readers at `value`, and replace each view by the same view of it."""
        for r in self.readers:
            r.inputs = [self.value if u is self.source else u for u in r.inputs]
        for view, readers in self.views:
            out = view.outputs[0]
            low = _bf16_value(out)
            twin = copy.copy(view)
            twin.inputs = [self.value if u is self.source else u for u in view.inputs]
            twin.outputs = [low]
            steps[next(i for i, s in enumerate(steps) if s is view)] = twin
            for r in readers:
                r.inputs = [low if u is out else u for u in r.inputs]


def bf16_twins(steps, graph_outputs) -> dict[int, list[tuple[int, Twin]]]:
    """{id(fused kernel step): [(output position, Twin)]}: the float32 results of fused
    kernels (`has_bf16_forms`) that bf16 steps read too, directly or through views only
    bf16 steps read, besides float32 readers (else `hand_off_in_bf16` hands them on in
    bf16 already). Nothing is changed until `Twin.rewire`."""
    readers = _readers(steps)
    outputs = set(graph_outputs)
    found: dict = {}
    for step in steps:
        if not has_bf16_forms(step):
            continue
        for position, v in enumerate(step.outputs):
            if position in step.fn.keep_low or v in outputs or v.type.dtype != torch.float32 \
                    or not v.type.is_static:
                continue
            direct = [r for r in readers.get(v, ()) if _rounds(r, v)]
            views = []
            for w in readers.get(v, ()):
                if _is_view(w) and len(w.outputs) == 1 and w.outputs[0] not in outputs:
                    onward = readers.get(w.outputs[0], [])
                    if onward and all(_rounds(r, w.outputs[0]) for r in onward):
                        views.append((w, onward))
            if direct or views:
                twin = Twin(v, _bf16_value(v), direct, views)
                found.setdefault(id(step), []).append((position, twin))
    return found


def _bf16_value(v: Value) -> Value:
    """A value beside `v` holding it rounded to bf16 (not in the graph: the executor gives
    it a slot of its own)."""
    return Value(f"{v.name}_bf16", TensorType(v.type.shape, LOW), v.producer)


def applies(precision: str, op: str) -> bool:
    """Whether a step computing `op` runs in bf16 under `precision`."""
    return precision == "bf16" and op in LOWERED_OPS


@lru_cache(maxsize=1)
def bf16_supported() -> bool:
    """Whether torch's oneDNN computes bf16 on this CPU. torch 2.13 refuses to pack a bf16
    weight on an AVX2-only CPU ("bf16 path needs the cpu support avx_ne_convert or
    avx512bw"), so there a bf16 library form could not even be made: a CPU compile then
    computes in float32 (`pipeline`, one warning)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# what "bf16x3" may compute from three bf16 parts: linear layers and convolutions with
# constant weights (library groups); products of two run-time operands stay float32
SPLIT_OPS = frozenset({"matmul", "conv"})


def splits(precision: str, op: str) -> bool:
    """Whether a library group anchored on `op` has a bf16x3 form under `precision`."""
    return precision == "bf16x3" and op in SPLIT_OPS


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from `/proc/cpuinfo` or the text given."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return set()


def units(cpuinfo: str | None = None) -> str:
    """The CPU's bf16 units (from `/proc/cpuinfo`'s flags, or the text given), as `explain`
    and the bench report them."""
    flags = cpu_flags(cpuinfo)
    if "amx_bf16" in flags:
        return "AMX bf16 tiles"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16 dot products (no AMX)"
    return "no bf16 units: oneDNN converts in software, slower than float32"


@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def tally(steps, precision: str = "bf16") -> tuple[int, int]:
    """(steps computing in `precision`, steps that could: products, convolutions and
    attention for bf16; library groups of linear layers and convolutions for int8 and
    bf16x3, of linear layers for int8-dynamic): what `explain` and the bench say of a
    compiled graph's precision."""
    from .int8 import quantized_ops

    if precision.startswith("int8"):  # only library groups (constant weights) quantize
        eligible = [s for s in steps if s.kind == "library"
                    and s.nodes[0].op in quantized_ops(precision)]
    elif precision == "bf16x3":  # and only they split
        eligible = [s for s in steps if s.kind == "library" and s.nodes[0].op in SPLIT_OPS]
    else:
        eligible = [s for s in steps if any(n.op in LOWERED_OPS for n in s.nodes)]
    return sum(s.precision == precision for s in eligible), len(eligible)
