"""Turn a partitioned graph into executable steps: library calls, generated C++ kernels,
and single ops.

`lower(graph)` partitions the graph, orders the groups topologically, renders every
generated kernel, builds them (few translation units, in parallel, cached on disk) and
returns `Step`s for the executor. If the compiler is missing or fails, the affected
groups run as their reference ops and a warning says so once; nothing else changes.
"""
from __future__ import annotations

import ctypes
import heapq
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import tune
from ..cost.model import active as active_machine
from ..ir import Graph
from ..ir.graph import Node, Value
from ..partition import Partition, Role, partition
from ..partition.legality import anchor_epilogue
from ..partition.classify import constant_of, is_column_sum
from . import anchor_group, attention, build, choice, gemm, kernel_schedule, library
from . import int8
from . import precision as prec
from .render import FUSIBLE, KernelSource, render
from .templates import render_single

KERNELS_PER_UNIT = 16
TARGETS = ("cpp", "triton")


class FusionWarning(UserWarning):
    """Fused kernels could not be built; the affected groups run unfused."""


@dataclass
class Step:
    fn: Callable                 # fn(*inputs) -> list of outputs
    inputs: list[Value]
    outputs: list[Value]
    nodes: list[Node]
    kind: str                    # "op", "library", "cpp", "triton", "reference"
    name: str = ""
    overwrites: Value | None = None  # an input whose storage the step writes its output into
    precision: str = "fp32"          # what its products compute in (codegen/precision.py)


@dataclass
class Lowered:
    steps: list[Step]
    partition: Partition | None
    sources: list[KernelSource] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rescheduled: int = 0  # generated kernels built on a schedule other than the default

    def kernel_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.steps:
            counts[s.kind] = counts.get(s.kind, 0) + 1
        return counts


def op_step(node: Node, precision: str = "fp32") -> Step:
    impl, attrs = node.opdef.impl, node.attrs
    if len(node.outputs) == 1:
        fn = lambda *args: [impl(*args, **attrs)]  # noqa: E731
    else:
        fn = lambda *args: list(impl(*args, **attrs))  # noqa: E731
    if prec.applies(precision, node.op):
        return Step(prec.LowPrecisionCall(fn), list(node.inputs), list(node.outputs), [node],
                    "op", f"{node.op} [{precision}]", precision=precision)
    if precision == "bf16" and node.op in prec.MIXED_OPS:
        fn = prec.MixedCall(fn)
    return Step(fn, list(node.inputs), list(node.outputs), [node], "op", node.op)


def zero_pad_step(graph: Graph, node: Node) -> Step | None:
    """A cat of one operand between blocks of constant zeros (how the frontends spell
    zero padding) as torch's `constant_pad_nd`, which keeps the operand's memory format:
    `cat` makes a channels-last activation row-major (96 x 113 x 113 floats before a
    depthwise convolution: 0.64 against 0.22 ms, and the convolution after it 0.22
    against 0.10 on the row-major copy; 2-core Zen 4). None where it is not one."""
    padding = zero_padding(graph, node)
    if padding is None:
        return None
    x, dim, before, after = padding
    pad = [0, 0] * (node.outputs[0].type.rank - 1 - dim) + [before, after]
    return Step(lambda t: [torch.constant_pad_nd(t, pad, 0.0)], [x],
                list(node.outputs), [node], "op", "cat (zero padding)")


def zero_padding(graph: Graph, node: Node) -> tuple[Value, int, int, int] | None:
    """(operand, dim, zeros before, zeros after) of a cat of one operand between blocks of
    constant zeros (how the frontends spell zero padding); None where it is not one."""
    if node.op != "cat":
        return None
    zero = [_is_constant(v) and _all_positive_zeros(graph.constants[v.producer.attrs["name"]])
            for v in node.inputs]
    if zero.count(False) != 1:
        return None
    k = zero.index(False)
    dim = node.attrs["dim"] % node.outputs[0].type.rank
    sizes = [v.type.shape[dim] for v in node.inputs]
    return node.inputs[k], dim, sum(sizes[:k]), sum(sizes[k + 1:])


def _absorbable_padding(graph, ctx, anchor: Node):
    """(unpadded operand, ((top, bottom), (left, right))) where a 2-D convolution reads
    zero padding written out along its height and width (nested cats, each read by
    nothing else) that its direct form can pad itself (`library.padding_absorbed`);
    None where there is none."""
    x = anchor.inputs[0]
    if anchor.op != "conv" or x.type.rank != 4 or not x.type.is_static:
        return None
    pads = {2: (0, 0), 3: (0, 0)}
    while x.producer is not None and x not in ctx.graph_outputs \
            and len(ctx.users.get(x, ())) == 1:
        padding = zero_padding(graph, x.producer)
        if padding is None or padding[1] not in pads or pads[padding[1]] != (0, 0):
            break
        x, dim, before, after = padding
        pads[dim] = (before, after)
    # the padding a side may gain: its total within the dilated kernel's reach
    reach = [d * (k - 1) - p for d, k, p in zip(anchor.attrs["dilation"],
                                                anchor.inputs[1].type.shape[2:],
                                                anchor.attrs["padding"])]
    if x is anchor.inputs[0] or any(max(pads[2 + i]) > r for i, r in enumerate(reach)):
        return None  # (none, or beyond the kernel's reach: left to the copy)
    return x, (pads[2], pads[3])


def tile_mean_step(node: Node) -> Step | None:
    """A mean over the tiles of a 4-D tensor's last two axes (how the ATen frontend spells
    average pooling whose windows tile the input, so a generated kernel can fuse it) as
    torch's `avg_pool2d` on the 4-D tensor, where it runs alone: torch's mean over the
    strided axes of a view of a channels-last activation took 1.44 ms for DenseNet-121's
    first transition (2x2 over 128 x 56 x 56, 2-core Zen 4), where the pooling kernel
    reads the channels as rows. None where it is not one."""
    if node.op != "mean" or node.attrs["keepdim"]:
        return None
    split = node.inputs[0]
    if split.producer is None or split.producer.op != "reshape" or split.type.rank != 6:
        return None
    x = split.producer.inputs[0]
    if x.type.rank != 4 or not x.type.is_static:
        return None
    n, c, h, w = x.type.shape
    kh, kw = split.type.shape[3], split.type.shape[5]
    if kh < 1 or kw < 1 or h % kh or w % kw \
            or tuple(split.type.shape) != (n, c, h // kh, kh, w // kw, kw) \
            or sorted(d % 6 for d in node.attrs["dims"]) != [3, 5]:
        return None
    return Step(lambda t: [torch.nn.functional.avg_pool2d(t, (kh, kw))], [x],
                list(node.outputs), [node], "op", "mean (tiles, as average pooling)")


def _all_positive_zeros(t: torch.Tensor) -> bool:
    return t.is_floating_point() and not bool(t.any()) and not bool(torch.signbit(t).any())


def gemm_step(node: Node) -> Step:
    """A product of two run-time matrices, on torch's or oneDNN's GEMM by measurement
    (at the first call, when strides are known; recorded in the active tuning database)."""
    db = tune.active()
    return Step(lambda a, b: [gemm.measured_matmul(a, b, db)], list(node.inputs),
                list(node.outputs), [node], "library", "matmul (measured GEMM)")


def attention_step(graph: Graph, node: Node, precision: str = "fp32") -> Step:
    """An attention in whichever of its forms measured faster at its shapes
    (codegen/attention.py; at compile time, recorded in the active tuning database),
    under precision "bf16" the fused kernel on bf16 operands among them; a mask of
    constant zeros is not read."""
    mask = constant_of(graph, node.inputs[3]) if len(node.inputs) == 4 else None
    name, fn, reads = attention.measured(node, tune.active(), mask, precision)
    computes_in = precision if name in attention.LOW_FORMS else "fp32"
    label = {attention.LOW_FORM: f"attention [{precision}]",
             attention.LOW_PER_HEAD: f"attention (per-head) [{precision}]"}.get(
                 name, f"attention ({name})")
    return Step(fn, list(node.inputs[:reads]), list(node.outputs), [node], "op", label,
                precision=computes_in)


def reference_fn(graph: Graph, nodes: list[Node], inputs: list[Value],
                 outputs: list[Value]) -> Callable:
    """The group's nodes run one by one as torch ops (the semantics every kernel matches);
    constants the group reads but does not take as inputs come from the graph."""
    calls = [(n.opdef.impl, n.attrs, n) for n in nodes]
    consts = {v: graph.constants[v.producer.attrs["name"]] for n in nodes for v in n.inputs
              if _is_constant(v) and v not in inputs}

    def run(*args):
        env = dict(consts)
        env.update(zip(inputs, args))
        for impl, attrs, n in calls:
            res = impl(*[env[v] for v in n.inputs], **attrs)
            for v, r in zip(n.outputs, res if len(n.outputs) > 1 else [res]):
                env[v] = r
        return [env[v] for v in outputs]
    return run


def lower(graph: Graph, mode: str = "ilp", measure: bool = True,
          ilp_seconds: float = 2.0, precision: str = "fp32",
          apart: frozenset[Node] = frozenset(), target: str = "cpp",
          kernels: str = "recorded", recheck: bool = False) -> Lowered:
    """Partition `graph` by `mode` ("ilp", "greedy"; "off": one step per op) and build its
    kernels. `measure=False` costs anchors by the roofline and always takes the library
    form (deterministic; tests that count kernels use it; the generated kernels' schedules
    still come from the tuning database under kernels="recorded"). `precision`: "bf16" computes
    products, convolutions and attention on bfloat16 operands, "bf16x3" offers linear layers
    and convolutions a form computed from three bf16 parts (codegen/precision.py).
    Nodes in `apart` are fused with nothing (masks the memory budget keeps).
    `target`: "cpp" (C++ kernels and oneDNN, for CPU tensors) or "triton" (Triton kernels
    and torch's CUDA libraries, for GPU tensors; codegen/triton). `kernels`: how the
    generated C++ kernels' schedules are chosen (codegen/kernel_schedule.py); `recheck`:
    measure the recorded library forms again (`choice.rechecking`)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}")
    kernel_schedule.check_mode(kernels)
    if mode != "off" and target == "triton":
        from .triton.lower import lower_for_triton
        return lower_for_triton(graph, mode, ilp_seconds, precision, apart)
    with choice.rechecking(recheck):
        return _lower_cpp(graph, mode, measure, ilp_seconds, precision, apart, kernels)


def _lower_cpp(graph, mode, measure, ilp_seconds, precision, apart, kernels) -> Lowered:
    """`lower` onto C++ kernels and oneDNN, or one step per op for `mode="off"`."""
    if mode == "off":
        steps = [op_step(n, precision) for n in graph.nodes if n.op != "constant"]
        if precision == "bf16":
            prec.hand_off_in_bf16(steps, graph.outputs)
        return Lowered(steps, None)
    measured = ((lambda ctx, g: measured_anchor_seconds(graph, ctx, g, precision))
                if measure else None)
    part = partition(graph, mode, FUSIBLE, ilp_seconds=ilp_seconds, anchor_seconds=measured,
                     apart=apart, conversion_seconds=_conversion_seconds(precision),
                     costs=(precision,), float32_residuals=precision == "bf16",
                     fused_bytes=prec.fused_bytes if precision == "bf16" else None)
    ctx = part.ctx
    lowered = Lowered([], part, notes=list(part.notes))
    pending: list[tuple[Step, KernelSource]] = []
    order = _topological(part)
    position = {n: i for i, g in enumerate(order) for n in g}
    for group in order:
        nodes = part.ordered(group)
        if len(nodes) == 1 and ctx.role[nodes[0]] is not Role.ANCHOR:
            single = nodes[0]
            src = render_single(single)
            if src is not None:
                _add_kernel(graph, lowered, pending, nodes, src)
            elif measure and gemm.applies(single) and not prec.applies(precision, single.op):
                lowered.steps.append(gemm_step(single))
            elif measure and attention.applies(single):
                lowered.steps.append(attention_step(graph, single, precision))
            else:
                lowered.steps.append(zero_pad_step(graph, single) or tile_mean_step(single)
                                     or op_step(single, precision))
            continue
        outputs = [v for n in nodes for v in n.outputs if ctx.escapes(v, group)]
        if ctx.role[nodes[0]] is Role.ANCHOR:
            inplace = _residual_is_dead(ctx, group, position)
            lowered.steps.append(_anchor_step(graph, ctx, group, nodes, outputs, measure, inplace,
                                              precision))
            continue
        escapes = (lambda v, g=group: ctx.escapes(v, g))
        _add_kernel(graph, lowered, pending, nodes, render(graph, nodes, escapes),
                    lambda schedule, nodes=nodes, escapes=escapes, low=None, twins=():
                    render(graph, nodes, escapes, schedule, low, twins))
    _build(pending, lowered, kernels)
    _drop_unread(lowered, graph)
    if precision == "bf16":
        prec.hand_off_in_bf16(lowered.steps, graph.outputs)
        _build_bf16_forms(lowered, graph)
    elif precision == "int8":  # (dynamic quantization measures each call's range itself)
        int8.link_requantization(graph, lowered.steps)
    return lowered


def _drop_unread(lowered: Lowered, graph: Graph) -> None:
    """Remove the steps whose values no later step reads and the caller does not get: the
    transposed views of weights that library forms hold packed (BERT-base: 49 of its 309
    steps, each a dispatch on every call)."""
    read = set(graph.outputs)
    kept = []
    for step in reversed(lowered.steps):
        if any(v in read for v in step.outputs) or any(n.opdef.is_random for n in step.nodes):
            kept.append(step)
            read.update(step.inputs)
    lowered.steps = kept[::-1]


def _add_kernel(graph, lowered: Lowered, pending: list, nodes, src: KernelSource,
                rerender=None) -> None:
    """A generated-kernel step; until (or unless) it builds, it runs its nodes as torch ops.
    `rerender(schedule)`: the same kernel under another schedule, where it has them."""
    step = Step(None, src.inputs, src.outputs, nodes, "cpp", src.name)
    step.fn = reference_fn(graph, nodes, src.inputs, src.outputs)
    lowered.steps.append(step)
    pending.append((step, src, rerender))


def _is_constant(v: Value) -> bool:
    return v.producer is not None and v.producer.op == "constant"


def _residual_is_dead(ctx, group, position) -> bool:
    """Whether a group's residual operand may be overwritten: it owns its storage (made by
    a non-view op, not an input, constant or graph output, with no views taken of it) and
    every other reader runs in an earlier step."""
    anchor = min(group, key=ctx.index.__getitem__)
    ep = anchor_epilogue(ctx, group)
    if isinstance(ep, str) or ep.binary is None or anchor.op != "conv":
        return False
    (other,) = anchor_group.group_inputs(anchor, ep)[1:]
    p = other.producer
    if p is None or p.op == "constant" or p.opdef.is_view or other in ctx.graph_outputs:
        return False
    here = position[anchor]
    return all(u is ep.binary or (not u.opdef.is_view and position[u] < here)
               for u in ctx.users.get(other, ()))


def _anchor_candidates(graph, ctx, group, nodes, outputs, inplace: bool = False,
                       precision: str = "fp32"):
    """(signature, {name: fn}, inputs, epilogue, inplace) for an anchor group: the library
    forms and the reference form (the nodes as torch ops, in float32)."""
    anchor = nodes[0]
    ep = anchor_epilogue(ctx, group)
    used = anchor_group.group_inputs(anchor, ep)
    # the reference form also reads the weight's view; the library form has it packed
    ins = used + [v for v in dict.fromkeys(v for n in nodes for v in n.inputs)
                  if v not in used and not ctx.producer_in(v, group) and not _is_constant(v)]
    candidates = {"reference": reference_fn(graph, nodes, ins, outputs)}
    k = len(used)
    for name, fn in library.forms(graph, anchor, ep, inplace, precision).items():
        candidates[name] = _Leading(fn, k)
    key = library.signature(graph, anchor, ep, precision, ctx.users)
    return key, candidates, ins, ep, inplace


def _anchor_step(graph, ctx, group, nodes, outputs, measure: bool, inplace: bool,
                 precision: str = "fp32") -> Step:
    key, candidates, ins, ep, inplace = _anchor_candidates(graph, ctx, group, nodes, outputs,
                                                           inplace, precision)
    if measure:
        chosen, _ = choice.choose(key, candidates, ins, work=_flops(nodes[0]))
    else:  # the precision's library form
        preferred = ("onednn-int8-direct", "onednn-int8", "onednn-bf16x3",
                     "onednn-direct-bf16", "onednn-bf16", "cpp-gemv", "onednn-winograd",
                     "onednn-direct", "onednn")
        chosen = next((c for c in preferred if c in candidates), "reference")
    kind = "reference" if chosen == "reference" else "library"
    name = "+".join([nodes[0].op] + [n.op for n in ep.chain])
    computes_in = "fp32"
    if chosen.endswith(prec.LOW_SUFFIX) or chosen.startswith("onednn-int8") \
            or chosen == "onednn-bf16x3":
        name += f" [{precision}]"
        computes_in = precision
    if chosen == "onednn-winograd":
        name += " [winograd]"  # profiles and reports say which convolutions transform
    overwrites = None
    if inplace and chosen.removesuffix(prec.LOW_SUFFIX) in (
            "onednn", "onednn-direct", "onednn-winograd", "onednn-int8", "onednn-int8-direct",
            "onednn-bf16x3"):
        name += " (into its residual)"
        overwrites = ins[1]
    fn = candidates[chosen]
    if isinstance(fn, _Leading):
        # the library form reads only its leading inputs: the weight's view the reference
        # form reads is then computed by no step (`_drop_unread`)
        fn, ins = fn.form, ins[:fn.k]
    absorbed = _absorbable_padding(graph, ctx, nodes[0]) \
        if chosen in ("onednn-direct", "onednn-direct" + prec.LOW_SUFFIX) else None
    if absorbed is not None:
        # it reads the operand before its zero padding, whose steps nothing else reads
        # then (`_drop_unread`), padding it itself (measured as the padded convolution)
        x, pads = absorbed
        fn = library.padding_absorbed(graph, nodes[0], ep, pads, inplace,
                                      low=chosen.endswith(prec.LOW_SUFFIX))
        ins = [x, *ins[1:]]
        name += " (zero padding absorbed)"
    if isinstance(fn, int8.Int8Group):
        fn.start_calibration()  # float32 until calibrated (codegen/int8.Calibration)
    return Step(fn, ins, outputs, nodes, kind, name, overwrites, computes_in)


class _Leading:
    """Calls a library form with the group's first `k` inputs (the reference form also
    reads the weight's view; the library form has it packed)."""

    def __init__(self, form: Callable, k: int):
        self.form, self.k = form, k

    def __call__(self, *args):
        return self.form(*args[:self.k])

    def measured_args(self, args: list) -> list:
        inner = getattr(self.form, "measured_args", None)
        return args if inner is None else [*inner(args[:self.k]), *args[self.k:]]

    def handed_on(self) -> "_Leading | None":
        """The form with its bf16 results left in bf16 (`LowPrecisionCall.handed_on`);
        None for a form that computes in float32."""
        if not isinstance(self.form, prec.LowPrecisionCall):
            return None
        return _Leading(self.form.handed_on(), self.k)


def measured_anchor_seconds(graph, ctx, group, precision: str = "fp32") -> float:
    """The measured time of an anchor group's best form (the partitioner's anchor cost).
    A group ending in an activation or a bias costs no more than the group without it:
    oneDNN applies either to the output tile before storing it, a few instructions an
    element, so the two measure within noise of each other, and noise alone had kept them
    apart: ReLUs (ResNet-50: 7 of its 49 as separate passes over their tensors, in one
    compile), and BERT-base's biases on a noisy 2-core Xeon (24 of the 36 that could fuse,
    as float32 adds, each product's result widened for them, in one compile). A group ending in a
    residual add costs no more than the group without it and a read of the residual at
    the roofline's memory speed, which is what the post-op adds (ResNet-50 on that Xeon:
    3 of its 16 residual adds as kernels of their own, in one compile)."""
    seconds = _measured_group_seconds(graph, ctx, group, precision)
    ep = anchor_epilogue(ctx, group)
    last = None if isinstance(ep, str) else ep.last
    if last is not None and last in (ep.unary, ep.bias, ep.binary):
        without = group - {last}
        # only where that is a group itself (not one left ending in a reshape)
        residual = [v.type for v in last.inputs if v.producer not in group] \
            if last is ep.binary else []
        if not isinstance(anchor_epilogue(ctx, without), str) \
                and all(t.is_static for t in residual):
            bound = measured_anchor_seconds(graph, ctx, without, precision)
            if residual:
                bound += active_machine().seconds(0, sum(t.nbytes for t in residual))
            seconds = min(seconds, bound)
    return seconds


def _measured_group_seconds(graph, ctx, group, precision: str) -> float:
    nodes = sorted(group, key=ctx.index.__getitem__)
    work = _flops(nodes[0])
    known = choice.measured(library.signature(graph, nodes[0], anchor_epilogue(ctx, group),
                                               precision, ctx.users), work)
    if known is not None:  # skip packing weights for a shape measured already
        return known
    outputs = [v for n in nodes for v in n.outputs if ctx.escapes(v, group)]
    key, candidates, ins, _, _ = _anchor_candidates(graph, ctx, group, nodes, outputs,
                                                    precision=precision)
    return choice.choose(key, candidates, ins, work=work)[1]


def _conversion_seconds(precision: str):
    """The partitioner's price of a float32 kernel between bf16 steps: the roofline time
    of the conversions it makes them do (`precision.conversion_bytes`), or None."""
    if not prec.applies(precision, "matmul"):
        return None

    def seconds(ctx, group) -> float:
        moved = prec.conversion_bytes(ctx, group)
        return active_machine().seconds(0, moved) if moved else 0.0
    return seconds


def _flops(anchor: Node) -> float:
    """The anchor's arithmetic: what its measured time scales with across sizes."""
    return float(anchor.opdef.cost([v.type for v in anchor.inputs],
                                   [v.type for v in anchor.outputs], anchor.attrs).flops)


def _build(pending, lowered: Lowered, kernels: str = "recorded") -> None:
    """Build the pending kernels, each under the schedule `kernels` chooses, and point
    their steps at them; if the compiler fails, they stay their torch ops, with a warning."""
    if not pending:
        return
    try:
        chosen = kernel_schedule.choose([(src, rerender) for _, src, rerender in pending], kernels)
        functions = kernel_schedule.build_functions(chosen, KERNELS_PER_UNIT)
    except build.BuildError as err:
        warnings.warn(f"opweave: generated kernels could not be built, so {len(pending)} fused "
                      f"groups run as separate ops: {err}", FusionWarning, stacklevel=3)
        lowered.sources = list({src.name: src for _, src, _ in pending}.values())
        for step, _, _ in pending:
            step.kind = "reference"
        return
    lowered.sources = list({src.name: src for src in chosen}.values())
    lowered.rescheduled = sum(src is not default for (_, default, _), src in zip(pending, chosen))
    for (step, _, rerender), src in zip(pending, chosen):
        fallback = step.fn if src.contiguous_only else None  # the reference: torch ops
        step.name = src.name
        bf16 = [functions.get(n) for n in src.bf16_names or ()]
        # (a column sum stores its result in a float32 pass of its own: no bf16 form)
        bf16_forms_from = None if any(is_column_sum(n) for n in step.nodes) else rerender
        step.fn = CppKernel(functions[src.name], src, fallback,
                            functions.get(src.channels_last_name), *bf16,
                            rerender=bf16_forms_from)


def _build_bf16_forms(lowered: Lowered, graph: Graph) -> None:
    """Give each generated kernel that reads a bf16 step's result, or whose results only
    bf16 steps read (`precision.hand_off_in_bf16` decided both), its form on those
    operands and results in bfloat16 (`bf16_forms`): no widened copy before it, no
    rounded copy after. A result that float32 steps read and bf16 products read too (a
    post-norm transformer's norm: the residual stream and the next products' operand)
    is also written rounded into a value of its own, which those products then read
    (`prec.bf16_twins`). Where the forms cannot be built, the kernels convert around
    their float32 forms, as they do for any operand of another type than they take."""
    twins = prec.bf16_twins(lowered.steps, graph.outputs)
    wanted = []
    for step, low_in in prec.bf16_kernel_operands(lowered.steps):
        low = (frozenset(low_in), step.fn.keep_low)
        made = tuple((position, twin.value) for position, twin in twins.get(id(step), ()))
        if low != (frozenset(), frozenset()) or made:
            wanted.append((step, low, made))
    if not wanted:
        return
    try:
        forms = bf16_forms([(step.fn, low, made) for step, low, made in wanted])
    except build.BuildError as err:
        warnings.warn(f"opweave: the bf16 forms of {len(wanted)} generated kernels could not "
                      f"be built, so they convert their operands around their float32 "
                      f"forms: {err}", FusionWarning, stacklevel=3)
        return
    for (step, _, made), form in zip(wanted, forms):
        step.fn, step.name = form, form.source.name
        step.outputs = list(step.outputs) + [value for _, value in made]
        lowered.sources.append(form.source)
    for made in twins.values():
        for _, twin in made:
            twin.rewire(lowered.steps)


def bf16_forms(wanted) -> list[CppKernel]:
    """Each fused kernel's form (`wanted`: (kernel, (input positions, output positions),
    twins)) reading those inputs and writing those outputs in bfloat16 and its twins
    after them (`render(..., low=, twins=)`), under the schedule chosen for it, with the
    kernel as its `general` form; built together. Raises build.BuildError."""
    sources = [kernel.rerender(kernel.source.schedule, low=low, twins=made)
               for kernel, low, made in wanted]
    functions = kernel_schedule.build_functions(sources, KERNELS_PER_UNIT)
    return [CppKernel(functions[src.name], src, kernel.fallback,
                      functions.get(src.channels_last_name), general=kernel)
            for (kernel, _, _), src in zip(wanted, sources)]


class CppKernel:
    """Calls one generated kernel: allocates its outputs, passes contiguous inputs. A
    layout-free kernel given inputs that share one dense layout (channels-last
    activations) runs in that layout and writes its outputs in it, copying nothing; a
    kernel with a channels-last variant runs that on channels-last inputs.

    Types: a template with bf16 variants (`passes_bf16`: max pooling) runs them on a bf16
    input, writing bf16. A fused kernel reads and writes bf16 where its source says
    (`KernelSource.low_inputs`, `low_outputs`: its bf16 form), float32 elsewhere; given
    operands of other types than those, it runs its float32 form (`general`) on them
    widened, exactly, and rounds the results in `keep_low` (what hand_off_in_bf16 decided
    to hand on in bf16) after it."""

    # runtime.native sets this while it records a call: told each kernel's address and
    # pointer arguments, so the native plan can call the kernel itself
    recording: Callable | None = None

    def __init__(self, fn, src: KernelSource, fallback: Callable | None = None,
                 channels_last_fn=None, bf16_fn=None, bf16_channels_last_fn=None,
                 general: CppKernel | None = None, rerender: Callable | None = None):
        self.fallback = fallback  # for inputs that are not contiguous, if given
        self.source = src  # what the profiler shows of it
        self.in_types = [torch.bfloat16 if i in src.low_inputs else v.type.dtype
                         for i, v in enumerate(src.inputs)]
        self.out_types = [(v.type.shape, torch.bfloat16 if i in src.low_outputs else v.type.dtype)
                          for i, v in enumerate(src.outputs)]
        self.argv = ctypes.c_void_p * (len(src.outputs) + len(src.inputs))
        self.layout_free = src.layout_free
        # the kernel, and the same for a channels-last input (its outputs row-major, or
        # channels-last where `channels_last_out`), if it has one: in float32 and in bf16
        self.functions = {torch.float32: (_addressed(fn), _addressed(channels_last_fn))}
        if bf16_fn is not None:
            self.functions[torch.bfloat16] = (_addressed(bf16_fn),
                                              _addressed(bf16_channels_last_fn))
        self.channels_last_out = src.channels_last_out
        self.dense_inputs = src.dense_inputs
        # the float32 form of a bf16 form: what runs on operands of other types
        self.general = general
        # the results handed on in bf16 (codegen/precision.hand_off_in_bf16)
        self.keep_low: frozenset[int] = src.low_outputs
        # the same kernel rendered anew under a schedule, and bf16 operands (`render`'s
        # `low`): set for fused kernels, None for templates; a bf16 form's is its general's
        self.rerender = general.rerender if general is not None else rerender

    @property
    def passes_bf16(self) -> bool:
        """Whether it computes on a bf16 input what it computes on the widened one, rounded,
        by only picking elements (a template's bf16 variant: max pooling)."""
        return torch.bfloat16 in self.functions

    def __call__(self, *inputs):
        low = self.passes_bf16 and inputs[0].dtype == torch.bfloat16
        if not low and any(x.dtype != want for x, want in zip(inputs, self.in_types)):
            return self._converting(inputs)
        outs = self._run(inputs, low)
        if outs is None:  # not its layout: torch's ops (float32) on the widened operands
            return self._converting(inputs)
        if not low and not self.keep_low <= self.source.low_outputs:  # no bf16 form built
            outs = [y.to(torch.bfloat16) if i in self.keep_low else y
                    for i, y in enumerate(outs)]
        return outs

    def _converting(self, inputs):
        """Its float32 form on the operands widened (exactly), the results in `keep_low`
        rounded: the values its bf16 form computes, for operands of types it does not
        take as they are."""
        wide = [x.float() if x.dtype == torch.bfloat16 else x for x in inputs]
        general = self.general or self
        if any(x.dtype != want for x, want in zip(wide, general.in_types)):
            raise TypeError(f"kernel {self.source.name} reads "
                            f"{', '.join(str(t).removeprefix('torch.') for t in general.in_types)}"
                            f"; got {', '.join(str(x.dtype).removeprefix('torch.') for x in inputs)}")
        outs = general._run(wide, False)
        if outs is None:
            outs = general.fallback(*wide)
        outs = list(outs) + [outs[i] for i in self.source.twins]  # rounded just below
        return [y.to(torch.bfloat16) if i in self.keep_low else y for i, y in enumerate(outs)]

    def _run(self, inputs, low: bool):
        """Its outputs, computed by its function for `inputs`' types and layout (bf16 or
        float32 for a template: `low`); None for a layout it leaves to `fallback`."""
        (fn, address), channels_last = self.functions[torch.bfloat16 if low else torch.float32]
        out_types = [(shape, torch.bfloat16) for shape, _ in self.out_types] if low \
            else self.out_types
        layout_kernel = False
        if not all(x.is_contiguous() for x in inputs):
            if channels_last is not None and self._channels_last(inputs):
                (fn, address), layout_kernel = channels_last, True
            elif self.fallback is not None:
                if self.general is None and (low or not self.keep_low):
                    return self.fallback(*inputs)  # torch's ops take either type
                return None
        if layout_kernel:
            layout = torch.channels_last if self.channels_last_out else torch.contiguous_format
            outs = [torch.empty(shape, dtype=dtype, memory_format=layout)
                    for shape, dtype in out_types]
            ins = inputs
        elif self.layout_free and not inputs[0].is_contiguous() and _same_dense_layout(inputs):
            outs = [torch.empty_like(inputs[0], dtype=dtype) for _, dtype in out_types]
            ins = inputs
        else:
            outs = [torch.empty(shape, dtype=dtype) for shape, dtype in out_types]
            ins = [x if x.is_contiguous() else x.contiguous() for x in inputs]
        if CppKernel.recording is not None:
            CppKernel.recording(address, [*outs, *ins])
        fn(self.argv(*[t.data_ptr() for t in outs], *[t.data_ptr() for t in ins]))
        return outs

    def _channels_last(self, inputs) -> bool:
        """Whether its channels-last form takes these inputs: all of them channels-last,
        or (a kernel that broadcasts some) the full-shape ones channels-last and the
        broadcast ones row-major."""
        if self.dense_inputs is None:
            return _same_dense_layout(inputs)
        return (_same_dense_layout([inputs[i] for i in self.dense_inputs])
                and all(x.is_contiguous() for i, x in enumerate(inputs)
                        if i not in self.dense_inputs))


def _addressed(fn) -> tuple | None:
    """A kernel function with its address (what a native plan's record holds), or None."""
    return None if fn is None else (fn, ctypes.cast(fn, ctypes.c_void_p).value)


def _same_dense_layout(tensors) -> bool:
    first = tensors[0]
    return (first.dim() == 4 and first.is_contiguous(memory_format=torch.channels_last)
            and all(t.stride() == first.stride() for t in tensors[1:]))


def _topological(part: Partition) -> list[frozenset[Node]]:
    """Groups in an order where every group runs after the groups it reads from."""
    ctx = part.ctx
    group_of = {n: g for g in part.groups for n in g}
    deps = {g: {group_of[v.producer] for n in g for v in n.inputs
                if v.producer in group_of and group_of[v.producer] is not g} for g in part.groups}
    users: dict[frozenset, list[frozenset]] = {g: [] for g in part.groups}
    for g, ds in deps.items():
        for d in ds:
            users[d].append(g)
    remaining = {g: len(ds) for g, ds in deps.items()}
    first = {g: min(ctx.index[n] for n in g) for g in part.groups}
    ready = [(first[g], i, g) for i, g in enumerate(part.groups) if remaining[g] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, g = heapq.heappop(ready)
        order.append(g)
        for u in users[g]:
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, (first[u], id(u), u))
    if len(order) != len(part.groups):
        raise AssertionError("fusion groups depend on each other in a cycle")
    return order
