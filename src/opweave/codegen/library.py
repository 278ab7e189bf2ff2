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
where oneDNN has bf16 primitives, beside torch's "onednn-bf16"); a 3x3 convolution of stride 1 also "onednn-winograd", Winograd's F(2x2, 3x3) with
its products on the same library (codegen/onednn_winograd.cpp). A linear layer of one row
also has the form "cpp-gemv", a kernel of opweave's own for products bound by streaming
their weight (codegen/gemv.py). Under precision "bf16x3" it also has the form
"onednn-bf16x3": the direct form computed from three bf16 parts of each operand,
float32's accuracy (codegen/precision.py). Each anchor group also has its reference form
(the same nodes as torch ops); which form runs is a measured choice (codegen/choice.py).
"""
from __future__ import annotations

from functools import cache, lru_cache
from typing import Callable

import torch

from ..ir import Graph
from ..ir.graph import Node, Value
from ..notices import warn_once
from ..partition.classify import constant_of
from ..partition.legality import Epilogue
from .. import shared_constants
from . import gemv, int8, onednn_direct, quantize
from . import precision as prec

_UNARY = {"relu": ("relu", [], ""), "tanh": ("tanh", [], ""), "sigmoid": ("sigmoid", [], "")}


def supports() -> bool:
    """Whether the library form applies (torch was built with oneDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _shaped(y: torch.Tensor, shape) -> torch.Tensor:
    """`y` viewed as `shape`, untouched when it already has it: a view re-derives the
    strides of size-1 axes, and torch then no longer sees a channels-last tensor as one
    (max pooling copied it to NCHW and ran 18x slower)."""
    return y if tuple(y.shape) == tuple(shape) else y.view(shape)


def group_inputs(anchor: Node, ep: Epilogue) -> list[Value]:
    """The values an anchor group reads at run time (weights and bias are baked in)."""
    ins = [anchor.inputs[0]]
    if ep.binary is not None:
        chained = {anchor.outputs[0]} | {n.outputs[0] for n in ep.chain}
        ins += [v for v in ep.binary.inputs if v not in chained]
    return ins


def _unary(ep: Epilogue):
    if ep.unary is None:
        return "none", [], ""
    if ep.unary.op == "gelu":
        return "gelu", [], ep.unary.attrs["approximate"]
    return _UNARY[ep.unary.op]


def forms(graph: Graph, anchor: Node, ep: Epilogue, inplace: bool = False,
          precision: str = "fp32") -> dict[str, Callable]:
    """The library forms of an anchor group, by name (all "onednn..." or "cpp-gemv"), to be
    measured. `inplace`: the residual operand is dead after this group, so a float32
    convolution may add into it in place (oneDNN's in-place binary post-op: 5% faster, one
    buffer fewer; a bf16 one reads a rounded copy of it). `precision`: "bf16" adds the
    same forms computing on bfloat16 operands, named with "-bf16" (the weight packed in
    bf16; codegen/precision.LowPrecisionCall: the result is widened back to float32 unless
    only bf16 steps read it), beside the float32 ones: a small or memory-bound product
    (GCN's) runs faster in float32, where the bf16 form's conversions cost more than its
    product saves (`choice._preferring_bf16`). "bf16x3" adds "onednn-bf16x3"; "int8" and
    "int8-dynamic" add the int8 forms where oneDNN fuses the group's epilogue
    (codegen/int8.py)."""
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
    if int8.applies(precision, anchor.op) and int8_supported() and _int8_fuses(anchor, ep):
        found.update(_int8_forms(graph, anchor, ep, out_shape, inplace, precision,
                                 found["onednn"]))
    if low:
        found.update({f"{name}{prec.LOW_SUFFIX}": prec.LowPrecisionCall(fn) for name, fn
                      in _forms_in(graph, anchor, ep, out_shape, False, low=True).items()})
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
    direct = _direct_fits(anchor, ep) and (_bf16_direct_offered() if low else _direct_offered())
    if anchor.op == "matmul":
        found = {"onednn": _linear(graph, anchor, ep, out_shape, low)}
        if direct:
            found["onednn-direct"] = _direct_linear(graph, anchor, ep, out_shape, low=low)
        if few_rows and _gemv_fits(anchor, ep) and _gemv_offered():
            found["cpp-gemv"] = _gemv(graph, anchor, ep, out_shape)
        return found
    found = {"onednn": _conv(graph, anchor, ep, out_shape, inplace, low)}
    if _pointwise_conv(anchor) and ep.binary is None:
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


def _pointwise_conv(anchor: Node) -> bool:
    a = anchor.attrs
    w = anchor.inputs[1].type.shape
    return (len(w) == 4 and w[2:] == (1, 1) and a["stride"] == [1, 1] and a["padding"] == [0, 0]
            and a["groups"] == 1 and anchor.inputs[0].type.shape[0] == 1)


def _conv_as_linear(graph, anchor, ep, out_shape, low=False):
    """A 1x1 convolution over a channels-last image is a GEMM [H*W, C] x [C, O]: run it
    as a packed linear layer (measured 2-7% faster than oneDNN's convolution here)."""
    _, c, h, w = anchor.inputs[0].type.shape
    o = anchor.inputs[1].type.shape[0]
    packed = _packed("linear-pack", graph, anchor.inputs[1], low, (c, _rows_hint(h * w)),
                     lambda weight: torch.ops.mkldnn._reorder_linear_weight(
                         weight.reshape(o, c).contiguous(), _rows_hint(h * w)))
    bias = _weight(graph, anchor.inputs[2], low).contiguous() if len(anchor.inputs) > 2 else None
    attr, scalars, algorithm = _unary(ep)
    op = torch.ops.mkldnn._linear_pointwise.default

    def gemm(x):
        rows = x.permute(0, 2, 3, 1).reshape(h * w, c)   # a view when x is channels-last
        y = op(rows, packed, bias, attr, scalars, algorithm)
        return [_shaped(y.view(1, h, w, o).permute(0, 3, 1, 2), out_shape)]
    return gemm


def _bias_input(anchor: Node, ep: Epilogue) -> Value | None:
    """The bias a linear group adds to its product, if any."""
    if ep.bias is None:
        return None
    return next(v for v in ep.bias.inputs if v is not anchor.outputs[0])


def _linear(graph, anchor, ep, out_shape, low=False):
    m = anchor.inputs[0].type.shape[0]
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    packed = _packed("linear-pack-t", graph, anchor.inputs[1], low, (_rows_hint(m),),
                     lambda weight: torch.ops.mkldnn._reorder_linear_weight(
                         weight.t().contiguous(), _rows_hint(m)))
    b = _bias_input(anchor, ep)
    bias = None if b is None else _weight(graph, b, low).reshape(n).contiguous()
    if ep.binary is not None:
        # the overload named: torch resolves `_linear_pointwise(x, other, ...)` by first
        # trying the unary schema, whose failure formats every tensor argument into an
        # error message: 5 ms a call for a 200x768 input (torch 2.13), 6x the product
        binary = torch.ops.mkldnn._linear_pointwise.binary
        return lambda x, other: [_shaped(binary(x, other.reshape(m, n), packed, bias, "add"),
                                         out_shape)]
    op = torch.ops.mkldnn._linear_pointwise.default
    attr, scalars, algorithm = _unary(ep)
    return lambda x: [_shaped(op(x, packed, bias, attr, scalars, algorithm), out_shape)]


def _as_2d(anchor: Node):
    """(one_d, input size, padding, stride, dilation) of a convolution as oneDNN runs it:
    a 1-D one as 2-D over a height of 1."""
    a = anchor.attrs
    size = list(anchor.inputs[0].type.shape)
    padding, stride, dilation = a["padding"], a["stride"], a["dilation"]
    one_d = len(size) == 3
    if one_d:
        size = size[:2] + [1] + size[2:]
        padding, stride, dilation = [0] + padding, [1] + stride, [1] + dilation
    return one_d, size, padding, stride, dilation


def _conv_views(one_d: bool, out_shape):
    """(to_2d, finish) of a convolution run as 2-D: a 1-D one's operands viewed over a
    height of 1, and its result viewed back, as the group's output shape."""
    def to_2d(t):
        return t.unsqueeze(2) if one_d else t

    def finish(y):
        return _shaped(y.squeeze(2) if one_d else y, out_shape)
    return to_2d, finish


def _conv(graph, anchor, ep, out_shape, inplace=False, low=False):
    """A 2-D convolution, or a 1-D one run as 2-D over a height of 1 (oneDNN packs only
    2-D and 3-D weights); a transposed [N, L, C] input viewed that way is channels-last
    already, so it is read in place where torch's conv1d would copy it."""
    bias = _weight(graph, anchor.inputs[2], low).contiguous() if len(anchor.inputs) > 2 else None
    one_d, size, padding, stride, dilation = _as_2d(anchor)
    geometry = (padding, stride, dilation, anchor.attrs["groups"])
    packed = _packed("conv-pack", graph, anchor.inputs[1], low,
                     (one_d, *map(tuple, geometry[:3]), geometry[3], tuple(size)),
                     lambda weight: torch.ops.mkldnn._reorder_convolution_weight(
                         weight.contiguous().unsqueeze(2) if one_d else weight.contiguous(),
                         *geometry, size))
    cl = torch.channels_last
    to_2d, finish = _conv_views(one_d, out_shape)

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
    attr, scalars, algorithm = _unary(ep)
    op = torch.ops.mkldnn._convolution_pointwise.default

    def conv(x):
        return [finish(op(to_2d(x), packed, bias, *geometry, attr, scalars, algorithm))]
    return conv


def _bf16_direct_offered() -> bool:
    """Whether the form "onednn-direct-bf16" is offered: where "onednn-direct" is, on a
    CPU where oneDNN's own library has bf16 primitives (`onednn_direct.bf16_problem`);
    elsewhere torch's "onednn-bf16" is the group's only bf16 form."""
    return _direct_offered() and onednn_direct.bf16_problem() is None


def _direct_offered() -> bool:
    """Whether the form "onednn-direct" is offered here: oneDNN's library is available,
    and the graph is compiled for one size. A primitive packs its weights for its own
    shapes, so the plans of a graph compiled for many sizes (docs/dynamic.md) would each
    hold a copy of them, where torch's packs are shared between them."""
    return not shared_constants.in_scope() and onednn_direct.library() is not None


def _direct_fits(anchor: Node, ep: Epilogue) -> bool:
    """Whether oneDNN's own library can run the group: a float32 product [M, K] x [K, N]
    or 1-D or 2-D convolution, no size 0, whose epilogue is one of its post-ops (torch's
    forms take the same ones)."""
    if any(0 in v.type.shape for v in anchor.inputs):
        return False
    floats = all(v.type.dtype == torch.float32 for v in anchor.inputs)
    rank = len(anchor.inputs[0].type.shape)
    if rank not in ((2,) if anchor.op == "matmul" else (3, 4)):
        return False
    return floats and _direct_unary(ep) in onednn_direct.UNARY


def _direct_unary(ep: Epilogue):
    """The epilogue's activation as `onednn_direct.UNARY` names it ("unknown" if none)."""
    if ep.unary is None:
        return None
    if ep.unary.op == "gelu":
        return "gelu", ep.unary.attrs["approximate"]
    return ep.unary.op if ep.unary.op in onednn_direct.UNARY else "unknown"


# the rows up to which a product is offered the few-row kernel. It streams its weight
# once per row: on the Zen 4, against the direct form (768x768, 768x3072, 3072x768 and
# ResNet-50's 2048x1000, warm, 2 threads) it ran 0.85-1.2x the time at 1 row but 1.4-2.5x
# at 2 rows and 2.7-3.6x at 16; cold, at 1 row, 4.4x faster (XML-CNN's output layer)
GEMV_ROWS = 1


def _gemv_fits(anchor: Node, ep: Epilogue) -> bool:
    """Whether the few-row product kernel is offered the group (codegen/gemv.py): a
    float32 product of at most GEMV_ROWS rows with the epilogues the direct form takes."""
    return anchor.op == "matmul" and _direct_fits(anchor, ep) \
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
    b = _bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b)
    product = gemv.Gemv(m, constant_of(graph, anchor.inputs[1]), bias, _direct_unary(ep),
                        residual=ep.binary is not None)

    def run(x, other=None):
        return [_shaped(product(x, None if other is None else other.reshape(m, n)), out_shape)]
    return run


def _bf16x3_offered(precision: str, anchor: Node, ep: Epilogue) -> bool:
    """Whether the group has the form "onednn-bf16x3": bf16x3 was asked for, the direct
    form is offered to the group, and oneDNN has bf16 products on this CPU (else one
    warning says the products stay float32)."""
    if not (prec.splits(precision, anchor.op) and _direct_fits(anchor, ep)
            and _direct_offered()):
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
    b = _bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b).reshape(n)
    binary = onednn_direct.NO_BINARY if ep.binary is None else onednn_direct.ADD
    product = onednn_direct.DirectLinear((m, k, n), constant_of(graph, anchor.inputs[1]), bias,
                                         _direct_unary(ep), binary, parts, low)

    def run(x, other=None):
        residual = None if other is None else other.reshape(m, n)
        return [_shaped(product(x, residual), out_shape)]
    return _unless_reference_only(run, lambda: _linear(graph, anchor, ep, out_shape, low))


def _direct_geometry(graph, anchor):
    """(one_d, weight, geometry) of a convolution as `onednn_direct.DirectConv` takes it,
    1-D ones as 2-D over a height of 1 as in `_conv`."""
    one_d, size, padding, stride, dilation = _as_2d(anchor)
    weight = constant_of(graph, anchor.inputs[1])
    weight = weight.unsqueeze(2) if one_d else weight
    geometry = (*size, weight.shape[0], *weight.shape[2:], anchor.attrs["groups"],
                *stride, *padding, *dilation)
    return one_d, weight, geometry


def _direct_conv(graph, anchor, ep, out_shape, inplace=False, parts: int = 1,
                 winograd: bool = False, low: bool = False):
    """The convolution on oneDNN's own library (codegen/onednn_direct.py), 1-D ones as 2-D
    over a height of 1 as in `_conv`; its primitive is made at its first call. `parts` and
    `low`: as for `_direct_linear`; `winograd`: as Winograd's F(2x2, 3x3)
    (`_winograd_fits`)."""
    one_d, weight, geometry = _direct_geometry(graph, anchor)
    bias = constant_of(graph, anchor.inputs[2]) if len(anchor.inputs) > 2 else None
    binary = onednn_direct.NO_BINARY if ep.binary is None else \
        onednn_direct.SUM_IN_PLACE if inplace else onednn_direct.ADD
    if winograd:
        conv = onednn_direct.WinogradConv(geometry, weight, bias, _direct_unary(ep), binary)
    else:
        conv = onednn_direct.DirectConv(geometry, weight, bias, _direct_unary(ep), binary,
                                        parts, low)

    to_2d, finish = _conv_views(one_d, out_shape)

    def run(x, other=None):
        return [finish(conv(to_2d(x), None if other is None else to_2d(other)))]
    return _unless_reference_only(run, lambda: _conv(graph, anchor, ep, out_shape, inplace,
                                                     low))


# the fewest input and output channels a convolution has Winograd's form for: its
# transforms work on 16 channels at once, and its products reduce over the input channels
WINOGRAD_MIN_CHANNELS = 16


def _winograd_fits(graph, anchor: Node, ep: Epilogue) -> bool:
    """Whether the convolution can have the form "onednn-winograd": a 2-D one that
    `onednn_direct.winograd_fits` (3x3, stride 1, dilation 1, one group, relu or no
    activation, finite constants) of at least WINOGRAD_MIN_CHANNELS channels in and out."""
    if anchor.op != "conv" or len(anchor.inputs[0].type.shape) != 4:
        return False
    _, weight, geometry = _direct_geometry(graph, anchor)
    bias = constant_of(graph, anchor.inputs[2]) if len(anchor.inputs) > 2 else None
    return min(geometry[1], geometry[4]) >= WINOGRAD_MIN_CHANNELS and \
        onednn_direct.winograd_fits(geometry, _direct_unary(ep), weight, bias)


def _winograd_offered() -> bool:
    """Whether the form "onednn-winograd" is offered here: where the direct form is, on a
    CPU whose oneDNN runs its products on brgemm kernels (`onednn_direct.winograd_problem`)."""
    return _direct_offered() and onednn_direct.winograd_problem() is None


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


def _int8_forms(graph, anchor, ep, out_shape, inplace, precision, fp32) -> dict:
    """The group's int8 forms by name ("onednn-int8", and "onednn-int8-gemm" for a 1x1
    convolution as a GEMM), or none (with one warning) where they cannot be made: the
    group then has its float32 forms only, and the rest of the graph is unaffected."""
    try:
        if precision == "int8-dynamic":
            forms = {"onednn-int8": _int8_linear_dynamic(graph, anchor, ep, out_shape)}
            if _int8_direct_offered(anchor, ep):
                forms.update(_int8_direct_dynamic(graph, anchor, ep, out_shape))
            return forms
        # a linear layer adding a residual writes float32; a convolution summing into one
        # writes the residual's type, uint8 where it arrives as codes
        conv = anchor.op == "conv"
        make = _int8_conv if conv else _int8_linear
        codes_in, codes_accum = _codes(graph, anchor, ep)

        def group(build):
            return int8.Int8Group(build, fp32, requantizes=conv or ep.binary is None,
                                  sums=conv and ep.binary is not None, codes_in=codes_in,
                                  codes_accum=codes_accum)
        made = make(graph, anchor, ep, out_shape, inplace)
        forms = {"onednn-int8": group(made)}
        if _int8_direct_offered(anchor, ep):
            forms["onednn-int8-direct"] = group(_int8_direct_or_torch(
                graph, anchor, ep, out_shape, inplace, made))
        if conv and _pointwise_conv(anchor) and ep.binary is None:
            forms["onednn-int8-gemm"] = int8.Int8Group(
                _int8_conv_as_linear(graph, anchor, ep, out_shape), fp32, requantizes=True,
                codes_in=codes_in)
        return forms
    except Exception as err:  # noqa: BLE001  (this group stays float32)
        types = ", ".join(str(v.type) for v in anchor.inputs)
        warn_once(f"opweave: a {anchor.op} group ({types}) has no int8 form and computes in "
                  f"float32: {type(err).__name__}: {err}", int8.Int8Warning)
        return {}


def _int8_direct_offered(anchor: Node, ep: Epilogue) -> bool:
    """Whether a static int8 group has the form "onednn-int8-direct": where the direct form
    is offered to it in float32, on a CPU where oneDNN's own library has int8 primitives
    (`onednn_direct.int8_problem`)."""
    return _direct_fits(anchor, ep) and _direct_offered() and onednn_direct.int8_problem() is None


def _int8_direct_conv(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a convolution group on oneDNN's own library: `build` as
    `_int8_conv`'s. Its primitive is made once per set of scales, with the requantization,
    bias, activation and residual sum fused; a residual it sums into is copied first
    unless it is dead after the group (`inplace`) or float32 (then the binary add reads
    it)."""
    one_d, _, geometry = _direct_geometry(graph, anchor)
    qweight, scales = _int8_weight(graph, anchor)  # those torch's int8 form packs
    qweight = qweight.unsqueeze(2) if one_d else qweight
    bias = _conv_bias(graph, anchor)
    unary = _direct_unary(ep)
    cl = torch.channels_last
    to_2d, finish = _conv_views(one_d, out_shape)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        binary = onednn_direct.NO_BINARY if ep.binary is None else \
            onednn_direct.SUM_IN_PLACE if inplace or out is not None else onednn_direct.ADD
        conv = onednn_direct.DirectConv(
            geometry, qweight, bias, unary, binary,
            quant=onednn_direct.Int8Quantization(scale, zero_point, scales, out, accum))
        conv.implementation()  # made now: ReferenceOnly is raised here, not in a call

        def run(x, other=None):
            x = to_2d(to_codes(x))
            if other is None:
                return [finish(conv(x))]
            acc = to_2d(other)
            if binary == onednn_direct.SUM_IN_PLACE and not inplace:
                acc = acc.clone(memory_format=cl)
            return [finish(conv(x, acc))]
        return run
    return build


def _int8_direct_product(graph, anchor, ep) -> Callable:
    """`make(**quantization)`: a linear group's direct int8 primitive, its
    `Int8Quantization` given all but the weight's scales, made at once, so that
    ReferenceOnly is raised there. Its int8 weight, scales and bias are taken now, at
    compile time. A residual it adds is float32, and so is its result then."""
    m, k = anchor.inputs[0].type.shape
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    qweight, scales = _int8_weight(graph, anchor)
    b = _bias_input(anchor, ep)
    bias = None if b is None else constant_of(graph, b).reshape(n)
    unary = _direct_unary(ep)
    binary = onednn_direct.NO_BINARY if ep.binary is None else onednn_direct.ADD

    def make(**quantization) -> onednn_direct.DirectLinear:
        quant = onednn_direct.Int8Quantization(weight_scales=scales, **quantization)
        product = onednn_direct.DirectLinear((m, k, n), qweight.t(), bias, unary, binary,
                                             quant=quant)
        product.implementation()
        return product
    return make


def _int8_direct_linear(graph, anchor, ep, out_shape):
    """The int8 form of a linear group on oneDNN's own library: `build` as `_int8_linear`'s."""
    m, n = anchor.inputs[0].type.shape[0], anchor.inputs[1].type.shape[1]
    make = _int8_direct_product(graph, anchor, ep)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        product = make(scale=scale, zero_point=zero_point, out=out)

        def run(x, other=None):
            residual = None if other is None else other.reshape(m, n)
            return [_shaped(product(to_codes(x), residual), out_shape)]
        return run
    return build


def _int8_direct_dynamic(graph, anchor, ep, out_shape) -> dict:
    """{"onednn-int8-direct": a linear group on oneDNN's own int8 primitive, its activation
    quantized at each call's own range}, or nothing where the primitive cannot be made
    (said once: torch's dynamic int8 form remains)."""
    m, n = anchor.inputs[0].type.shape[0], anchor.inputs[1].type.shape[1]
    try:
        product = _int8_direct_product(graph, anchor, ep)(scale=1.0, zero_point=0,
                                                           dynamic=True)
    except (onednn_direct.ReferenceOnly, RuntimeError, ValueError) as err:
        _no_direct_int8(anchor, err)
        return {}
    to_codes = quantize.DynamicQuantizer()

    def linear(x, other=None):
        codes, scale, zero_point = to_codes(x)
        residual = None if other is None else other.reshape(m, n)
        return [_shaped(product(codes, residual, (scale, zero_point)), out_shape)]
    return {"onednn-int8-direct": linear}


def _no_direct_int8(anchor: Node, err: Exception) -> None:
    """Says once that a group has no direct int8 form, and why."""
    types = ", ".join(str(v.type) for v in anchor.inputs)
    warn_once(f"opweave: a {anchor.op} group ({types}) has no direct int8 form "
              f"({type(err).__name__}: {err}); torch's oneDNN int8 form runs instead",
              onednn_direct.OneDNNWarning)


def _int8_direct_or_torch(graph, anchor, ep, out_shape, inplace, torch_build) -> Callable:
    """The direct int8 form's `build`, which builds torch's int8 form instead (said once)
    where the direct one cannot be made: its primitive is oneDNN's reference
    implementation (`ReferenceOnly`, 100-1000x slower), or oneDNN refuses it. The group
    keeps an int8 form either way."""
    try:
        direct = _int8_direct_conv(graph, anchor, ep, out_shape, inplace) \
            if anchor.op == "conv" else _int8_direct_linear(graph, anchor, ep, out_shape)
    except (RuntimeError, ValueError) as err:
        _no_direct_int8(anchor, err)
        return torch_build

    def build(*qparams):
        try:
            return direct(*qparams)
        except (onednn_direct.ReferenceOnly, RuntimeError, ValueError) as err:
            _no_direct_int8(anchor, err)
            return torch_build(*qparams)
    return build


@lru_cache(maxsize=1)
def int8_supported() -> bool:
    """Whether torch has oneDNN's int8 primitives."""
    return supports() and all(hasattr(torch.ops.onednn, op) for op in
                              ("qlinear_pointwise", "qconv2d_pointwise", "qlinear_prepack",
                               "qconv_prepack"))


def _codes(graph: Graph, anchor: Node, ep: Epilogue) -> tuple[bool, bool]:
    """Whether a static int8 group's input, and its residual, may arrive as uint8 codes
    (int8.arrives_as_codes): its int8 form is measured on them so."""
    operands = group_inputs(anchor, ep)
    return (int8.arrives_as_codes(graph, operands[0]),
            len(operands) > 1 and int8.arrives_as_codes(graph, operands[1]))


def _int8_fuses(anchor: Node, ep: Epilogue) -> bool:
    """Whether oneDNN's int8 primitive computes the whole group (its unary epilogue is one
    it fuses; a 2-D or 1-D convolution; a linear layer over rows)."""
    if ep.unary is not None and ep.unary.op not in int8.FUSED_UNARY[anchor.op]:
        return False
    rank = len(anchor.inputs[0].type.shape)
    return rank == 2 if anchor.op == "matmul" else rank in (3, 4)


def _int8_output(out) -> tuple[float, int, torch.dtype | None]:
    """oneDNN's (output scale, zero point, dtype) for an int8 product: float32, or uint8
    codes at `out` = (scale, zero point)."""
    return (1.0, 0, torch.float32) if out is None else (*out, None)


def _conv_bias(graph, anchor) -> torch.Tensor | None:
    """A convolution's constant bias in float32, as the int8 primitives read it."""
    return constant_of(graph, anchor.inputs[2]).float().contiguous() \
        if len(anchor.inputs) > 2 else None


def _int8_weight(graph, anchor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, scale per output channel) of a convolution ([O, C/groups, ...]) or
    linear layer ([N, K]: the [K, N] weight transposed), quantized once for every form of
    a sharing scope that reads it."""
    w = constant_of(graph, anchor.inputs[1])
    linear = anchor.op == "matmul"
    suffix = "-t" if linear else ""
    # (one quantization for both, where neither is shared yet)
    qparams = cache(lambda: quantize.weight_qparams(w.t() if linear else w))
    return (shared_constants.derived("int8-weight" + suffix, [w], (), lambda: qparams()[0]),
            shared_constants.derived("int8-scales" + suffix, [w], (), lambda: qparams()[1]))


def _int8_linear_parts(graph, anchor, ep):
    """(rows, columns, packed int8 weight, its scales, zero points, bias) of a linear group."""
    m, k = anchor.inputs[0].type.shape
    n = anchor.inputs[1].type.shape[1]                       # the weight is [K, N]
    w = constant_of(graph, anchor.inputs[1])
    qweight, scales = _int8_weight(graph, anchor)
    packed = shared_constants.derived(
        "qlinear-pack", [w], (m,), lambda: torch.ops.onednn.qlinear_prepack(qweight, [m, k]))
    bias = None
    if ep.bias is not None:
        b = next(v for v in ep.bias.inputs if v is not anchor.outputs[0])
        bias = constant_of(graph, b).reshape(n).float().contiguous()
    return m, n, packed, scales, torch.zeros(n, dtype=torch.long), bias


def _int8_linear(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a linear group: `build(scale, zero point, out, accum)`
    (int8.Int8Group; a linear layer's residual stays float32, so `accum` is None)."""
    m, n, packed, scales, zero_points, bias = _int8_linear_parts(graph, anchor, ep)
    attr, scalars, algorithm = _unary(ep)

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)
        if ep.binary is not None:
            op = torch.ops.onednn.qlinear_pointwise.binary
            return lambda x, other: [_shaped(op(
                to_codes(x), scale, zero_point, packed, scales, zero_points,
                other.reshape(m, n), bias, o_scale, o_zp, o_dtype, 1.0, 0, "add", 1.0,
                attr, scalars, algorithm), out_shape)]
        op = torch.ops.onednn.qlinear_pointwise.default
        return lambda x: [_shaped(op(to_codes(x), scale, zero_point, packed, scales,
                                     zero_points, bias, o_scale, o_zp, o_dtype, attr, scalars,
                                     algorithm), out_shape)]
    return build


def _int8_conv_as_linear(graph, anchor, ep, out_shape):
    """A 1x1 convolution over a channels-last image in int8 as a GEMM [H*W, C] x [C, O]
    (`qlinear_pointwise`: about 8 µs less per call than the convolution op, and a few
    percent faster on ResNet-50's shapes): `build` as `_int8_conv`'s, without residual."""
    _, c, h, w = anchor.inputs[0].type.shape
    o = anchor.inputs[1].type.shape[0]
    weight = constant_of(graph, anchor.inputs[1])
    qweight, scales = _int8_weight(graph, anchor)
    packed = shared_constants.derived(
        "qlinear-pack-1x1", [weight], (h * w,),
        lambda: torch.ops.onednn.qlinear_prepack(qweight.reshape(o, c), [h * w, c]))
    zero_points = torch.zeros(o, dtype=torch.long)
    bias = _conv_bias(graph, anchor)
    attr, scalars, algorithm = _unary(ep)
    op = torch.ops.onednn.qlinear_pointwise.default

    def build(scale, zero_point, out, accum):
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)

        def gemm(x):
            rows = to_codes(x).permute(0, 2, 3, 1).reshape(h * w, c)  # a view if channels-last
            y = op(rows, scale, zero_point, packed, scales, zero_points, bias, o_scale, o_zp,
                   o_dtype, attr, scalars, algorithm)
            return [_shaped(y.view(1, h, w, o).permute(0, 3, 1, 2), out_shape)]
        return gemm
    return build


def _int8_linear_dynamic(graph, anchor, ep, out_shape):
    """A linear group in int8 with its activation quantized at each call's own range."""
    m, n, packed, scales, zero_points, bias = _int8_linear_parts(graph, anchor, ep)
    attr, scalars, algorithm = _unary(ep)
    to_codes = quantize.DynamicQuantizer()
    if ep.binary is not None:
        op = torch.ops.onednn.qlinear_pointwise.binary_tensor

        def linear_add(x, other):
            codes, scale, zero_point = to_codes(x)
            return [_shaped(op(codes, scale, zero_point, packed, scales, zero_points,
                               other.reshape(m, n), bias, 1.0, 0, torch.float32, 1.0, 0, "add",
                               1.0, attr, scalars, algorithm), out_shape)]
        return linear_add
    op = torch.ops.onednn.qlinear_pointwise.tensor

    def linear(x):
        codes, scale, zero_point = to_codes(x)
        return [_shaped(op(codes, scale, zero_point, packed, scales, zero_points, bias, 1.0, 0,
                           torch.float32, attr, scalars, algorithm), out_shape)]
    return linear


def _int8_conv(graph, anchor, ep, out_shape, inplace=False):
    """The int8 form of a convolution group (1-D ones as 2-D over a height of 1); with a
    residual add, oneDNN sums into an accumulator: the residual itself where it is dead
    after the group (`inplace`), else a copy of it; float32, or uint8 codes at `accum`
    (then the result is uint8 codes at `out`)."""
    w = constant_of(graph, anchor.inputs[1])
    bias = _conv_bias(graph, anchor)
    one_d, size, padding, stride, dilation = _as_2d(anchor)
    groups = anchor.attrs["groups"]
    qweight, scales = _int8_weight(graph, anchor)
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    cl = torch.channels_last
    to_2d, finish = _conv_views(one_d, out_shape)

    def build(scale, zero_point, out, accum):
        packed = torch.ops.onednn.qconv_prepack(
            qweight.unsqueeze(2) if one_d else qweight, scales, scale, zero_point, stride,
            padding, dilation, groups, size)
        to_codes = quantize.Quantizer(scale, zero_point)
        o_scale, o_zp, o_dtype = _int8_output(out)
        if ep.binary is not None:
            op = torch.ops.onednn.qconv2d_pointwise.binary
            unary = ep.unary.op if ep.unary is not None else "none"
            # the accumulator's (scale, zero point): float32 ones must be (1, 0)
            a_scale, a_zp = accum if accum is not None else (1.0, 0)
            assert (accum is None) == (out is None), "the sum keeps the residual's type"

            def conv_add(x, other):
                acc = to_2d(other)
                acc = acc.contiguous(memory_format=cl) if inplace else acc.clone(memory_format=cl)
                return [finish(op(to_2d(to_codes(x)), scale, zero_point, packed, scales,
                                  zero_points, acc, bias, stride, padding, dilation, groups,
                                  o_scale, o_zp, o_dtype, a_scale, a_zp, "sum", 1.0, unary,
                                  [], ""))]
            return conv_add
        op = torch.ops.onednn.qconv2d_pointwise.default
        attr, scalars, algorithm = _unary(ep)
        return lambda x: [finish(op(to_2d(to_codes(x)), scale, zero_point, packed, scales,
                                    zero_points, bias, stride, padding, dilation, groups,
                                    o_scale, o_zp, o_dtype, attr, scalars, algorithm))]
    return build


def signature(graph: Graph, anchor: Node, ep: Epilogue, precision: str = "fp32") -> tuple:
    posts = tuple((n.op, repr(sorted(n.attrs.items()))) for n in ep.chain)
    key = (anchor.op, tuple(sorted((k, str(v)) for k, v in anchor.attrs.items())),
           tuple(str(v.type) for v in anchor.inputs), posts)
    if _direct_fits(anchor, ep) and not _direct_offered():
        # measured without that form: a choice among fewer forms is another decision (a
        # graph compiled for many sizes must not overwrite what one size chose)
        key += (("without", "onednn-direct"),)
    elif prec.applies(precision, anchor.op) and _direct_fits(anchor, ep) \
            and not _bf16_direct_offered():
        key += (("without", "onednn-direct" + prec.LOW_SUFFIX),)
    if not prec.applies(precision, anchor.op) and _gemv_fits(anchor, ep) \
            and not _gemv_offered():
        key += (("without", "cpp-gemv"),)
    if _winograd_fits(graph, anchor, ep) and _direct_offered() and not _winograd_offered():
        # (without the direct form it is withheld too, which the key says already)
        key += (("without", "onednn-winograd"),)
    if int8.applies(precision, anchor.op) and _direct_fits(anchor, ep) and _direct_offered() \
            and _int8_fuses(anchor, ep) and not _int8_direct_offered(anchor, ep):
        key += (("without", "onednn-int8-direct"),)
    # float32 keys stay as they were, so records made before precisions existed still count
    if precision == "int8" and int8.applies(precision, anchor.op):
        # its int8 form's time depends on whether its operands arrive as codes
        return key + (("precision", precision), ("codes", *_codes(graph, anchor, ep)))
    if prec.applies(precision, anchor.op) and \
            prec.may_arrive_in_bf16(anchor.inputs[0], frozenset(graph.outputs)):
        # its bf16 form is then kept within a margin (`choice._preferring_bf16`)
        return key + (("precision", precision), ("reads", "bf16"))
    lowered = prec.applies(precision, anchor.op) or int8.applies(precision, anchor.op) \
        or _bf16x3_offered(precision, anchor, ep)
    return key + (("precision", precision),) if lowered else key
