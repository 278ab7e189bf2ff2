"""Anchor groups on a library: oneDNN through torch, with the epilogue as post-ops.

A linear layer runs as `mkldnn._linear_pointwise` over a weight packed once at compile
time (oneDNN's blocked layout; measured 15-25% faster than MKL's sgemm on the 2-core
AMD machines), with bias, an activation or a residual add applied to the output tile
before it is stored. A convolution runs as `mkldnn._convolution_pointwise` on a packed
weight; oneDNN writes channels-last outputs whatever the input layout, so activations
stay channels-last from one convolution to the next (a residual operand is brought to
that layout). ReLU and residual adds are post-ops. A float32 convolution or linear layer
also has the form "onednn-direct": the same post-ops on oneDNN's own library, its
primitive made once (codegen/onednn_direct.py), kept unless another form measures clearly
faster (under precision "bf16" also "onednn-direct-bf16", on bf16 operands and results,
where oneDNN has bf16 primitives, beside torch's "onednn-bf16"); a 3x3 convolution of
stride 1 also "onednn-winograd", Winograd's F(2x2, 3x3) with its products on the same
library (codegen/onednn_winograd.cpp). A linear layer of one row
also has the form "cpp-gemv", a kernel of opweave's own for products bound by streaming
their weight (codegen/gemv.py). Under precision "bf16x3" it also has the form
"onednn-bf16x3": the direct form computed from three bf16 parts of each operand,
float32's accuracy (codegen/precision.py). Each anchor group also has its reference form
(the same nodes as torch ops); which form runs is a measured choice (codegen/choice.py).
The int8 forms are in codegen/library_int8.py, what the forms share about a group in
codegen/anchor_group.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import shared_constants
from ..ir import Graph
from ..ir.graph import Node, Value
from ..notices import warn_once
from ..partition.classify import constant_of
from ..partition.legality import Epilogue
from . import gemv, int8, library_int8, onednn_direct
from . import precision as prec
from .anchor_group import (as_2d, bias_input, conv_views, direct_fits, direct_geometry,
                           direct_offered, direct_unary, group_inputs, pointwise_conv, shaped,
                           supports, torch_unary)


def forms(graph: Graph, anchor: Node, ep: Epilogue, inplace: bool = False,
          precision: str = "fp32") -> dict[str, Callable]:
    """The library forms of an anchor group, by name (all "onednn..." or "cpp-gemv"), to be
    measured. `inplace`: the residual operand is dead after this group, so a convolution
    may add into it in place (oneDNN's sum post-op: one buffer fewer; in float32 5%
    faster, in bf16 on AMX 10-18%, on a Zen 4 level; a bf16 one adds into its residual as
    it reads it: the residual's own storage where it arrives in bf16, else the rounded
    copy, which no one else reads). `precision`: "bf16" adds the
    same forms computing on bfloat16 operands, named with "-bf16" (the weight packed in
    bf16; codegen/precision.LowPrecisionCall: the result is widened back to float32 unless
    only bf16 steps read it), beside the float32 ones: a small or memory-bound product
    (GCN's) runs faster in float32, where the bf16 form's conversions cost more than its
    product saves (`choice._preferring_bf16`). "bf16x3" adds "onednn-bf16x3"; "int8" and
    "int8-dynamic" add the int8 forms where oneDNN fuses the group's epilogue
    (codegen/library_int8.py)."""
    if not supports():
        return {}
    low = prec.applies(precision, anchor.op)
    out_shape = (ep.last or anchor).outputs[0].type.shape
    found = _forms_in(graph, anchor, ep, out_shape, inplace, low=False, few_rows=not low)
    if _bf16x3_offered(precision, anchor, ep):
        if anchor.op == "matmul":
            found["onednn-bf16x3"] = _direct_linear(graph, anchor, ep, out_shape, parts=3)
        else:
            found["onednn-bf16x3"] = _direct_conv(graph, anchor, ep, out_shape, inplace,
                                                  parts=3)
    if int8.applies(precision, anchor.op) and library_int8.supported() \
            and library_int8.fuses(anchor, ep):
        found.update(library_int8.int8_forms(graph, anchor, ep, out_shape, inplace, precision,
                                 found["onednn"]))
    if low:
        found.update({f"{name}{prec.LOW_SUFFIX}": prec.LowPrecisionCall(fn) for name, fn
                      in _forms_in(graph, anchor, ep, out_shape, inplace, low=True).items()})
    return found


def _forms_in(graph, anchor, ep, out_shape, inplace: bool, low: bool,
              few_rows: bool = False) -> dict[str, Callable]:
    """The group's forms in one type: float32, or bfloat16 operands and result (`low`,
    where oneDNN's own library has bf16 primitives for the direct form; Winograd's
    transform is float32 only). `few_rows`: with the few-row kernel, float32 only too,
    and not offered beside bf16 forms: it streams the float32 weight, twice the bf16
    form's bytes, which the forms' warm measurement does not see (XML-CNN's [1, 768] x
    [768, 512] layer measured 25 us on it against 43 in bf16, yet the model ran no
    faster with it: 0.575 / 0.585 / 0.561 ms against 0.572 / 0.570 / 0.558 on a Zen 4)."""
    direct = direct_fits(anchor, ep) and (_bf16_direct_offered(anchor) if low else direct_offered())
    if anchor.op == "matmul":
        found = {"onednn": _linear(graph, anchor, ep, out_shape, low)}
        if direct:
            found["onednn-direct"] = _direct_linear(graph, anchor, ep, out_shape, low=low)
        if few_rows and _gemv_fits(anchor, ep) and _gemv_offered():
            found["cpp-gemv"] = _gemv(graph, anchor, ep, out_shape)
        return found
    found = {}
    if not (low and direct and amx_convolutions_direct()):
        found["onednn"] = _conv(graph, anchor, ep, out_shape, inplace, low)
        if pointwise_conv(anchor) and ep.binary is None:
            found["onednn-gemm"] = _conv_as_linear(graph, anchor, ep, out_shape, low)
    if direct:
        found["onednn-direct"] = _direct_conv(graph, anchor, ep, out_shape, inplace, low=low)
    if direct and not low and _winograd_fits(graph, anchor, ep) and _winograd_offered():
        found["onednn-winograd"] = _direct_conv(graph, anchor, ep, out_shape, inplace,
                                                winograd=True)
    return found


def _weight(graph: Graph, v: Value, low: bool) -> torch.Tensor:
    """A constant weight or bias as the library reads it: bfloat16 when the group computes
    in it."""
    w = constant_of(graph, v)
    return w.to(prec.LOW) if low else w


def _packed(kind: str, graph: Graph, v: Value, low: bool, params: tuple, pack):
    """`pack(weight)` for the constant `v`, made once for the plans of one sharing scope
    that pack the same weight the same way (a symbolic graph's plans: one per size)."""
    return shared_constants.derived(kind, [constant_of(graph, v)], (low, *params),
                                    lambda: pack(_weight(graph, v, low)))


def _rows_hint(rows: int) -> int:
    """The batch size oneDNN packs a linear weight for. Its layout differed only between
    1 row and more (measured on Zen 4, 2 to 2048 rows: the same speed with any pack of 2
    or more), so one pack serves every row count above 1."""
    return 1 if rows == 1 else 64


def _conv_as_linear(graph, anchor, ep, out_shape, low=False):
    """A 1x1 convolution over a channels-last image is a GEMM [H*W, C] x [C, O]: run it
    as a packed linear layer (measured 2-7% faster than oneDNN's convolution here)."""
    _, c, h, w = anchor.inputs[0].type.shape
    o = anchor.inputs[1].type.shape[0]
    packed = _packed("linear-pack", graph, anchor.inputs[1], low, (c, _rows_hint(h * w)),
                     lambda weight: torch.ops.mkldnn._reorder_linear_weight(
                         weight.reshape(o, c).contiguous(), _rows_hint(h * w)))
    bias = _weight(graph, anchor.inputs[2], low).contiguous() if len(anchor.inputs) > 2 else None
    attr, scalars, algorithm = torch_unary(ep)
    op = torch.ops.mkldnn._linear_pointwise.default

    def gemm(x):
        rows = x.permute(0, 2, 3, 1).reshape(h * w, c)   # a view when x is channels-last
        y = op(rows, packed, bias, attr, scalars, algorithm)
        return [shaped(y.view(1, h, w, o).permute(0, 3, 1, 2), out_shape)]
    return gemm


def _linear(graph, anchor, ep, out_shape, low=False):
    m = anchor.inputs[0].type.shape[0]
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    packed = _packed("linear-pack-t", graph, anchor.inputs[1], low, (_rows_hint(m),),
                     lambda weight: torch.ops.mkldnn._reorder_linear_weight(
                         weight.t().contiguous(), _rows_hint(m)))
    b = bias_input(anchor, ep)
    bias = None if b is None else _weight(graph, b, low).reshape(n).contiguous()
    if ep.binary is not None:
        # the overload named: torch resolves `_linear_pointwise(x, other, ...)` by first
        # trying the unary schema, whose failure formats every tensor argument into an
        # error message: 5 ms a call for a 200x768 input (torch 2.13), 6x the product
        binary = torch.ops.mkldnn._linear_pointwise.binary
        return lambda x, other: [shaped(binary(x, other.reshape(m, n), packed, bias, "add"),
                                         out_shape)]
    op = torch.ops.mkldnn._linear_pointwise.default
    attr, scalars, algorithm = torch_unary(ep)
    return lambda x: [shaped(op(x, packed, bias, attr, scalars, algorithm), out_shape)]


def _conv(graph, anchor, ep, out_shape, inplace=False, low=False):
    """A 2-D convolution, or a 1-D one run as 2-D over a height of 1 (oneDNN packs only
    2-D and 3-D weights); a transposed [N, L, C] input viewed that way is channels-last
    already, so it is read in place where torch's conv1d would copy it."""
    bias = _weight(graph, anchor.inputs[2], low).contiguous() if len(anchor.inputs) > 2 else None
    one_d, size, padding, stride, dilation = as_2d(anchor)
    geometry = (padding, stride, dilation, anchor.attrs["groups"])
    packed = _packed("conv-pack", graph, anchor.inputs[1], low,
                     (one_d, *map(tuple, geometry[:3]), geometry[3], tuple(size)),
                     lambda weight: torch.ops.mkldnn._reorder_convolution_weight(
                         weight.contiguous().unsqueeze(2) if one_d else weight.contiguous(),
                         *geometry, size))
    cl = torch.channels_last
    to_2d, finish = conv_views(one_d, out_shape)

    if ep.binary is not None:
        unary = ep.unary.op if ep.unary is not None else None
        if inplace:
            op = torch.ops.mkldnn._convolution_pointwise_.binary

            def conv_add_into(x, other):
                acc = to_2d(other).contiguous(memory_format=cl)   # a copy only if not already
                return [finish(op(acc, to_2d(x), packed, bias, *geometry, "add", 1.0, unary, [], ""))]
            return conv_add_into
        op = torch.ops.mkldnn._convolution_pointwise.binary

        def conv_add(x, other):
            return [finish(op(to_2d(x), to_2d(other).contiguous(memory_format=cl), packed,
                              bias, *geometry, "add", 1.0, unary, [], ""))]
        return conv_add
    attr, scalars, algorithm = torch_unary(ep)
    op = torch.ops.mkldnn._convolution_pointwise.default

    def conv(x):
        return [finish(op(to_2d(x), packed, bias, *geometry, attr, scalars, algorithm))]
    return conv


def _bf16_direct_offered(anchor: Node) -> bool:
    """Whether the form "onednn-direct-bf16" is offered: where "onednn-direct" is, on a
    CPU where oneDNN's own library has bf16 primitives (`onednn_direct.bf16_problem`);
    elsewhere torch's "onednn-bf16" is the group's only bf16 form. Not for products on a
    CPU with AMX (`amx_products_on_torch`)."""
    if anchor.op == "matmul" and amx_products_on_torch():
        return False
    return direct_offered() and onednn_direct.bf16_problem() is None


def amx_products_on_torch() -> bool:
    """Whether bf16 products run on torch's oneDNN only: on CPUs with AMX bf16 tiles. There
    oneDNN 3.2's AMX products (the direct form's library) measured level with torch's
    (oneDNN 3.12) or faster, warm, one weight called again and again, and ran slower in
    the model, where each product's weight comes from memory: BERT-base 1.18-1.31x
    slower with them than without, ViT-B/16 1.09x (2-core Xeon, family 6 model 207, one
    process, the two compiles alternating call by call; `perf`: the direct library's
    kernels took 1.6x the CPU time of torch's in the model). Convolutions keep the form:
    ResNet-50 ran faster with it (docs/precision.md)."""
    return "amx_bf16" in prec.cpu_flags()


def amx_convolutions_direct() -> bool:
    """Whether bf16 convolutions run on oneDNN's own library only, where it has their
    direct form: on CPUs with AMX bf16 tiles. There torch's bf16 forms (its convolution,
    a 1x1 one as its linear layer) measured faster alone at some shapes and ran slower in
    the model: with them on the direct form instead, ResNet-50 took 0.96x and 0.98x the
    time, DenseNet-121 0.94x, RegNet 0.96x, MobileNetV2 0.95x (2-core Xeon, family 6
    model 207, one process, the two compiles called alternately, medians of 200-300
    pairs). The mirror of `amx_products_on_torch`; why each library runs slower in the
    model than alone is not known."""
    return "amx_bf16" in prec.cpu_flags()


# the rows up to which a product is offered the few-row kernel. It streams its weight
# once per row: on the Zen 4, against the direct form (768x768, 768x3072, 3072x768 and
# ResNet-50's 2048x1000, warm, 2 threads) it ran 0.85-1.2x the time at 1 row but 1.4-2.5x
# at 2 rows and 2.7-3.6x at 16; cold, at 1 row, 4.4x faster (XML-CNN's output layer)
GEMV_ROWS = 1


def _gemv_fits(anchor: Node, ep: Epilogue) -> bool:
    """Whether the few-row product kernel is offered the group (codegen/gemv.py): a
    float32 product of at most GEMV_ROWS rows with the epilogues the direct form takes."""
    return anchor.op == "matmul" and direct_fits(anchor, ep) \
        and anchor.inputs[0].type.shape[0] <= GEMV_ROWS


def _gemv_offered() -> bool:
    """Whether the form "cpp-gemv" is offered here: the kernel builds, and the graph is
    compiled for one size (it keeps its own copy of the weight, as the direct form does,
    where the plans of a graph compiled for many sizes share torch's packs)."""
    return not shared_constants.in_scope() and gemv.kernel() is not None


def _gemv(graph, anchor, ep, out_shape):
    """The product on the few-row kernel, with `_linear`'s bias, residual add and
    activation applied as each output is stored."""
    m, n = anchor.inputs[0].type.shape[0], anchor.inputs[1].type.shape[1]
    b = bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b)
    product = gemv.Gemv(m, constant_of(graph, anchor.inputs[1]), bias, direct_unary(ep),
                        residual=ep.binary is not None)

    def run(x, other=None):
        return [shaped(product(x, None if other is None else other.reshape(m, n)), out_shape)]
    return run


def _bf16x3_offered(precision: str, anchor: Node, ep: Epilogue) -> bool:
    """Whether the group has the form "onednn-bf16x3": bf16x3 was asked for, the direct
    form is offered to the group, and oneDNN has bf16 products on this CPU (else one
    warning says the products stay float32)."""
    if not (prec.splits(precision, anchor.op) and direct_fits(anchor, ep)
            and direct_offered()):
        return False
    problem = onednn_direct.bf16x3_problem()
    if problem is not None:
        warn_once(f"opweave: precision 'bf16x3' computes in float32 here: {problem}",
                  onednn_direct.OneDNNWarning)
    return problem is None


def _direct_linear(graph, anchor, ep, out_shape, parts: int = 1, low: bool = False):
    """The product on oneDNN's own library (codegen/onednn_direct.py), with the bias,
    activation and residual add of `_linear` as post-ops; from three bf16 parts of each
    operand where `parts` is 3 (bf16x3); on bf16 operands, to a bf16 result, where `low`."""
    m, k = anchor.inputs[0].type.shape
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    b = bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b).reshape(n)
    binary = onednn_direct.NO_BINARY if ep.binary is None else onednn_direct.ADD
    product = onednn_direct.DirectLinear((m, k, n), constant_of(graph, anchor.inputs[1]), bias,
                                         direct_unary(ep), binary, parts, low)

    def run(x, other=None):
        residual = None if other is None else other.reshape(m, n)
        return [shaped(product(x, residual), out_shape)]
    return _unless_reference_only(run, lambda: _linear(graph, anchor, ep, out_shape, low))


def _direct_conv(graph, anchor, ep, out_shape, inplace=False, parts: int = 1,
                 winograd: bool = False, low: bool = False, absorbed=None):
    """The convolution on oneDNN's own library (codegen/onednn_direct.py), 1-D ones as 2-D
    over a height of 1 as in `_conv`; its primitive is made at its first call. `parts` and
    `low`: as for `_direct_linear`; `winograd`: as Winograd's F(2x2, 3x3)
    (`_winograd_fits`). `absorbed`: ((before, after) rows, (before, after) columns) of
    zero padding written out before a 2-D one, which it reads unpadded instead."""
    one_d, weight, geometry = direct_geometry(graph, anchor)
    bias = constant_of(graph, anchor.inputs[2]) if len(anchor.inputs) > 2 else None
    binary = onednn_direct.NO_BINARY if ep.binary is None else \
        onednn_direct.SUM_IN_PLACE if inplace else onednn_direct.ADD
    pad = None
    if absorbed is not None:
        (top, bottom), (left, right) = absorbed
        pad = [left, right, top, bottom]
        shape = list(geometry)  # the unpadded input, padded by the primitive
        ph, pw = shape[10:12]
        shape[2:4] = [shape[2] - top - bottom, shape[3] - left - right]
        shape[10:12] = [ph + top, pw + left]
        geometry = (*shape, ph + bottom, pw + right)

    def torch_form():  # where oneDNN has only its reference: torch's form, on the padded input
        run = _conv(graph, anchor, ep, out_shape, inplace, low)
        if pad is None:
            return run
        return lambda x, other=None: run(torch.constant_pad_nd(x, pad, 0.0), other)
    if winograd:
        conv = onednn_direct.WinogradConv(geometry, weight, bias, direct_unary(ep), binary)
    else:
        conv = onednn_direct.DirectConv(geometry, weight, bias, direct_unary(ep), binary,
                                        parts, low)

    to_2d, finish = conv_views(one_d, out_shape)

    def run(x, other=None):
        return [finish(conv(to_2d(x), None if other is None else to_2d(other)))]
    return _unless_reference_only(run, torch_form)


def padding_absorbed(graph, anchor: Node, ep: Epilogue, absorbed, inplace: bool = False,
                     low: bool = False) -> Callable:
    """The form "onednn-direct" (bf16: "onednn-direct-bf16") of a 2-D convolution that
    reads its operand before the zero padding written out in front of it (`absorbed`, as
    `_direct_conv` takes it): oneDNN pads each side by its own amount, where torch's
    convolution pads both equally, so TensorFlow's "SAME" padding (one more row and
    column after than before, at stride 2) is no longer a copy of the activation."""
    out_shape = (ep.last or anchor).outputs[0].type.shape
    fn = _direct_conv(graph, anchor, ep, out_shape, inplace, low=low, absorbed=absorbed)
    return prec.LowPrecisionCall(fn) if low else fn


# the fewest input and output channels a convolution has Winograd's form for: its
# transforms work on 16 channels at once, and its products reduce over the input channels
WINOGRAD_MIN_CHANNELS = 16


def _winograd_fits(graph, anchor: Node, ep: Epilogue) -> bool:
    """Whether the convolution can have the form "onednn-winograd": a 2-D one that
    `onednn_direct.winograd_fits` (3x3, stride 1, dilation 1, one group, relu or no
    activation, finite constants) of at least WINOGRAD_MIN_CHANNELS channels in and out."""
    if anchor.op != "conv" or len(anchor.inputs[0].type.shape) != 4:
        return False
    _, weight, geometry = direct_geometry(graph, anchor)
    bias = constant_of(graph, anchor.inputs[2]) if len(anchor.inputs) > 2 else None
    return min(geometry[1], geometry[4]) >= WINOGRAD_MIN_CHANNELS and \
        onednn_direct.winograd_fits(geometry, direct_unary(ep), weight, bias)


def _winograd_offered() -> bool:
    """Whether the form "onednn-winograd" is offered here: where the direct form is, on a
    CPU whose oneDNN runs its products on brgemm kernels (`onednn_direct.winograd_problem`)."""
    return direct_offered() and onednn_direct.winograd_problem() is None


def _unless_reference_only(run: Callable, torch_form: Callable[[], Callable]) -> Callable:
    """`run`, unless its primitive turns out, at its first call, to be oneDNN's reference
    implementation (it would be 100-1000x slower; a measured choice never picks it, but
    `measure=False` takes the direct form unmeasured): then torch's form, said once."""
    instead: list[Callable] = []

    def call(*args):
        if not instead:
            try:
                return run(*args)
            except onednn_direct.ReferenceOnly as err:
                warn_once(f"opweave: {err}; torch's oneDNN form runs instead",
                          onednn_direct.OneDNNWarning)
                instead.append(torch_form())
        return instead[0](*args)
    return call


def signature(graph: Graph, anchor: Node, ep: Epilogue, precision: str = "fp32",
              users: dict | None = None) -> tuple:
    """The key of the group's measured form: its shapes and post-ops, the forms withheld
    here, and under a lower precision how its operands arrive and its result leaves
    (`users`: value -> the nodes reading it, the graph's own when not given)."""
    posts = tuple((n.op, repr(sorted(n.attrs.items()))) for n in ep.chain)
    key = (anchor.op, tuple(sorted((k, str(v)) for k, v in anchor.attrs.items())),
           tuple(str(v.type) for v in anchor.inputs), posts)
    if direct_fits(anchor, ep) and not direct_offered():
        # measured without that form: a choice among fewer forms is another decision (a
        # graph compiled for many sizes must not overwrite what one size chose)
        key += (("without", "onednn-direct"),)
    elif prec.applies(precision, anchor.op) and direct_fits(anchor, ep) \
            and not _bf16_direct_offered(anchor):
        key += (("without", "onednn-direct" + prec.LOW_SUFFIX),)
    elif prec.applies(precision, anchor.op) and anchor.op == "conv" \
            and direct_fits(anchor, ep) and amx_convolutions_direct():
        key += (("without", "onednn" + prec.LOW_SUFFIX),)  # nor its linear-layer form
    if not prec.applies(precision, anchor.op) and _gemv_fits(anchor, ep) \
            and not _gemv_offered():
        key += (("without", "cpp-gemv"),)
    if _winograd_fits(graph, anchor, ep) and direct_offered() and not _winograd_offered():
        # (without the direct form it is withheld too, which the key says already)
        key += (("without", "onednn-winograd"),)
    if int8.applies(precision, anchor.op) and direct_fits(anchor, ep) and direct_offered() \
            and library_int8.fuses(anchor, ep) and not library_int8.int8_direct_offered(anchor, ep):
        key += (("without", "onednn-int8-direct"),)
    # float32 keys stay as they were, so records made before precisions existed still count
    if precision == "int8" and int8.applies(precision, anchor.op):
        # its int8 form's time depends on whether its operands arrive as codes
        codes = library_int8.codes_arriving(graph, anchor, ep)
        return key + (("precision", precision), ("codes", *codes))
    outputs = frozenset(graph.outputs)
    if prec.applies(precision, anchor.op):
        reads = prec.may_arrive_in_bf16(anchor.inputs[0], outputs)
        leaves = prec.may_leave_in_bf16((ep.last or anchor).outputs[0],
                                        graph.users() if users is None else users, outputs)
        if reads:
            # its bf16 form is then kept within a margin (`choice._preferring_bf16`)
            key += (("precision", precision), ("reads", "bf16"))
            residual = group_inputs(anchor, ep)[1:]
            if residual and prec.may_arrive_in_bf16(residual[0], outputs):
                # measured on a bf16 residual too (`choice.handed_bf16`)
                key += (("residual", "bf16"),)
        if leaves:
            # measured with its result as its readers take it (`choice.leaving_bf16`)
            key += (() if reads else (("precision", precision),)) + (("leaves", "bf16"),)
        if reads or leaves:
            return key
    lowered = prec.applies(precision, anchor.op) or int8.applies(precision, anchor.op) \
        or _bf16x3_offered(precision, anchor, ep)
    return key + (("precision", precision),) if lowered else key
