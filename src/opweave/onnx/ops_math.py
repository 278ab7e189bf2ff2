"""ONNX operators -> IR ops: elementwise, activations, linear algebra, normalization,
pooling and reductions. Each handler gets the lowering, the node, its input Values (None
for omitted optional inputs) and its attributes, and returns its output Values.

A handler raises OnnxUnsupported (through `refuse`) for any attribute value or type it does
not implement exactly, so that an imported model is either right or refused, never
silently wrong.
"""
from __future__ import annotations

import math

import torch

from ..ir import dtypes, padding, symbols
from .errors import OnnxUnsupported, where
from .importer import Lowering, handles, torch_dtype

FLOATS = dtypes.FLOAT_DTYPES


def refuse(low: Lowering, why: str):
    """Refuse the node being lowered, saying why."""
    raise OnnxUnsupported(f"{where(low.node)}: {why}")


def axis_of(low, axis: int, rank: int) -> int:
    """A possibly negative ONNX axis as an index into `rank` dims."""
    if not -rank <= axis < max(rank, 1):
        refuse(low, f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def need_float(low, value, what="input"):
    if value.type.dtype not in FLOATS:
        refuse(low, f"{what} has type {value.type.dtype}; only floating point is supported")


# -- elementwise -----------------------------------------------------------------------------

_UNARY = {"Neg": "neg", "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
          "Reciprocal": "reciprocal", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf",
          "Relu": "relu", "Sin": "sin", "Cos": "cos", "Sign": "sign", "Ceil": "ceil",
          "Floor": "floor"}
_FLOAT_UNARY = {"Exp", "Log", "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Erf", "Sin", "Cos",
                "Ceil", "Floor"}


@handles(*_UNARY)
def _unary(low, node, ins, attrs):
    if node.op_type in _FLOAT_UNARY:
        need_float(low, ins[0])
    if node.op_type in ("Neg", "Abs", "Relu", "Sign") and ins[0].type.dtype in (torch.bool, torch.uint8):
        refuse(low, f"{node.op_type} of {ins[0].type.dtype} is not supported")
    return [low.emit1(_UNARY[node.op_type], [ins[0]])]


@handles("Not")
def _not(low, node, ins, attrs):
    return [low.emit1("logical_not", [ins[0]])]


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Equal": "eq", "Less": "lt",
           "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "And": "logical_and",
           "Or": "logical_or", "Xor": "ne"}


@handles(*_BINARY)
def _binary(low, node, ins, attrs):
    a, b = ins
    if a.type.dtype != b.type.dtype:
        refuse(low, f"inputs have different types {a.type.dtype} and {b.type.dtype}")
    if node.op_type in ("Add", "Sub", "Mul") and a.type.dtype in (torch.bool,):
        refuse(low, "arithmetic on bool")
    return [low.emit1(_BINARY[node.op_type], [a, b])]


@handles("Div")
def _div(low, node, ins, attrs):
    a, b = ins
    if a.type.dtype != b.type.dtype:
        refuse(low, f"inputs have different types {a.type.dtype} and {b.type.dtype}")
    if a.type.dtype in FLOATS:
        return [low.emit1("div", [a, b])]
    if a.type.dtype in dtypes.INT_DTYPES:  # integer division truncates, as numpy's astype
        return [low.emit1("div", [a, b], {"rounding": "trunc"})]
    refuse(low, f"Div of {a.type.dtype} is not supported")


@handles("Pow")
def _pow(low, node, ins, attrs):
    """The result has the base's type; an integer base is raised in float64 and truncated
    back, as the reference's numpy power followed by astype."""
    x, y = ins
    if x.type.dtype in FLOATS:
        if y.type.dtype != x.type.dtype:
            y = low.emit1("cast", [y], {"dtype": x.type.dtype})
        return [low.emit1("pow", [x, y])]
    if x.type.dtype not in (torch.int64, torch.int32) or y.type.dtype == torch.bool:
        refuse(low, f"Pow of {x.type.dtype}")
    wide = [low.emit1("cast", [v], {"dtype": torch.float64}) for v in (x, y)]
    return [low.emit1("cast", [low.emit1("pow", wide)], {"dtype": x.type.dtype})]


@handles("Max", "Min", "Sum", "Mean")
def _variadic(low, node, ins, attrs):
    if not ins or any(v is None for v in ins):
        refuse(low, "needs at least one input")
    if any(v.type.dtype != ins[0].type.dtype for v in ins):
        refuse(low, "inputs of different types")
    if node.op_type in ("Sum", "Mean"):
        need_float(low, ins[0])
    op = {"Max": "maximum", "Min": "minimum", "Sum": "add", "Mean": "add"}[node.op_type]
    result = ins[0]
    if len(ins) == 1:  # a single input still broadcasts nothing: identity
        return [result]
    for other in ins[1:]:
        result = low.emit1(op, [result, other])
    if node.op_type == "Mean":
        result = low.emit1("div", [result, low.scalar(len(ins), result)])
    return [result]


@handles("Where")
def _where(low, node, ins, attrs):
    cond, a, b = ins
    if a.type.dtype != b.type.dtype:
        refuse(low, "branches of different types")
    return [low.emit1("where", [cond, a, b])]


@handles("Cast")
def _cast(low, node, ins, attrs):
    target = torch_dtype(attrs["to"], f"{where(node)} target")
    source = ins[0].type.dtype
    if source in FLOATS and target in dtypes.INT_DTYPES + (torch.bool,):
        refuse(low, "float to integer casts differ for NaN and out-of-range values")
    if source == target:
        return [ins[0]]
    return [low.emit1("cast", [ins[0]], {"dtype": target})]


@handles("CastLike")
def _cast_like(low, node, ins, attrs):
    target = ins[1].type.dtype
    if ins[0].type.dtype in FLOATS and target in dtypes.INT_DTYPES + (torch.bool,):
        refuse(low, "float to integer casts differ for NaN and out-of-range values")
    if ins[0].type.dtype == target:
        return [ins[0]]
    return [low.emit1("cast", [ins[0]], {"dtype": target})]


@handles("Identity")
def _identity(low, node, ins, attrs):
    return [ins[0]]


@handles("Dropout")
def _dropout(low, node, ins, attrs):
    training = ins[2] if len(ins) > 2 else None
    if training is not None and bool(low.require_const(training, "training_mode").item()):
        refuse(low, "training-mode dropout is not supported")
    mask = None
    if len([o for o in node.output if o]) > 1:
        mask = low.constant(torch.ones(ins[0].type.shape, dtype=torch.bool), "mask")
    return [ins[0], mask]


@handles("IsNaN")
def _isnan(low, node, ins, attrs):
    need_float(low, ins[0])
    return [low.emit1("ne", [ins[0], ins[0]])]


@handles("IsInf")
def _isinf(low, node, ins, attrs):
    x = ins[0]
    need_float(low, x)
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    checks = ([low.emit1("eq", [x, low.scalar(math.inf, x)])] if pos else []) + \
             ([low.emit1("eq", [x, low.scalar(-math.inf, x)])] if neg else [])
    if not checks:
        return [low.constant(torch.zeros(x.type.shape, dtype=torch.bool), "false")]
    return [checks[0] if len(checks) == 1 else low.emit1("logical_or", checks)]


@handles("Clip")
def _clip(low, node, ins, attrs):
    """Bounds known at import as the IR's clamp (which becomes a convolution's or product's
    post-op: ReLU6); bounds computed at run time as maximum and minimum."""
    x = ins[0]
    if x.type.dtype == torch.bool:
        refuse(low, "Clip of bool")
    lo = ins[1] if len(ins) > 1 else None
    hi = ins[2] if len(ins) > 2 else None
    bounds = [low.const_of(b) if b is not None else None for b in (lo, hi)]
    if x.type.dtype in FLOATS and all(b is None or b.numel() == 1 for b in bounds) \
            and any(b is not None for b in bounds) \
            and all((b is None) == (v is None) for b, v in zip(bounds, (lo, hi))):
        lo_v, hi_v = (float(b.item()) if b is not None else None for b in bounds)
        return [low.emit1("clamp", [x], {"min": lo_v, "max": hi_v})]
    if lo is not None:
        x = low.emit1("maximum", [x, lo])
    if hi is not None:
        x = low.emit1("minimum", [x, hi])
    return [x]


@handles("Gelu")
def _gelu(low, node, ins, attrs):
    need_float(low, ins[0])
    approximate = attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        refuse(low, f"approximate={approximate!r}")
    return [low.emit1("gelu", [ins[0]], {"approximate": approximate})]


@handles("LeakyRelu", "PRelu", "ThresholdedRelu", "Elu", "Selu", "Celu", "HardSigmoid",
         "HardSwish", "Softsign")
def _activation(low, node, ins, attrs):
    """Composite activations; half-precision inputs are computed in float32 and rounded
    once at the end, as the ONNX reference does."""
    x = ins[0]
    need_float(low, x)
    if x.type.dtype in (torch.float16, torch.bfloat16):
        wide = [low.emit1("cast", [v], {"dtype": torch.float32}) if v is not None else None
                for v in ins]
        out = _activation_f32(low, node, wide, attrs)
        return [low.emit1("cast", [out], {"dtype": x.type.dtype})]
    return [_activation_f32(low, node, ins, attrs)]


def _activation_f32(low, node, ins, attrs):
    x = ins[0]
    s = lambda v: low.scalar(v, x)
    e = low.emit1
    op = node.op_type
    if op == "LeakyRelu":
        return e("where", [e("lt", [x, s(0.0)]), e("mul", [x, s(attrs.get("alpha", 0.01))]), x])
    if op == "PRelu":
        if ins[1].type.dtype != x.type.dtype:
            refuse(low, "slope of another type")
        return e("where", [e("lt", [x, s(0.0)]), e("mul", [x, ins[1]]), x])
    if op == "ThresholdedRelu":
        return e("where", [e("gt", [x, s(attrs.get("alpha", 1.0))]), x, s(0.0)])
    if op in ("Elu", "Selu", "Celu"):
        alpha = attrs.get("alpha", {"Elu": 1.0, "Selu": 1.6732632423543772, "Celu": 1.0}[op])
        if op == "Celu":  # max(0,x) + min(0, alpha*(exp(x/alpha)-1))
            neg = e("mul", [e("sub", [e("exp", [e("div", [x, s(alpha)])]), s(1.0)]), s(alpha)])
        else:
            neg = e("mul", [e("sub", [e("exp", [x]), s(1.0)]), s(alpha)])
        out = e("where", [e("gt", [x, s(0.0)]), x, neg])
        if op == "Selu":
            out = e("mul", [out, s(attrs.get("gamma", 1.0507009873554805))])
        return out
    if op in ("HardSigmoid", "HardSwish"):
        alpha, beta = (attrs.get("alpha", 0.2), attrs.get("beta", 0.5)) if op == "HardSigmoid" \
            else (1 / 6, 0.5)
        hs = e("clamp", [e("add", [e("mul", [x, s(alpha)]), s(beta)])], {"min": 0.0, "max": 1.0})
        return hs if op == "HardSigmoid" else e("mul", [x, hs])
    # Softsign
    return e("div", [x, e("add", [e("abs", [x]), s(1.0)])])


# -- linear algebra --------------------------------------------------------------------------

@handles("MatMul")
def _matmul(low, node, ins, attrs):
    """numpy matmul: 1-d operands gain a dim that is dropped from the result."""
    a, b = ins
    need_float(low, a)
    if a.type.rank == 0 or b.type.rank == 0:
        refuse(low, "MatMul of a scalar")
    a2 = low.emit1("reshape", [a], {"shape": [1, a.type.shape[0]]}) if a.type.rank == 1 else a
    b2 = low.emit1("reshape", [b], {"shape": [b.type.shape[0], 1]}) if b.type.rank == 1 else b
    out = low.emit1("matmul", [a2, b2])
    if a.type.rank == 1 or b.type.rank == 1:
        shape = list(out.type.shape)
        if b.type.rank == 1:
            shape.pop(-1)
        if a.type.rank == 1:
            shape.pop(-1 if b.type.rank == 1 else -2)
        out = low.emit1("reshape", [out], {"shape": shape})
    return [out]


@handles("Gemm")
def _gemm(low, node, ins, attrs):
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    need_float(low, a)
    if attrs.get("transA", 0):
        a = low.emit1("permute", [a], {"dims": [1, 0]})
    if attrs.get("transB", 0):
        b = low.emit1("permute", [b], {"dims": [1, 0]})
    y = low.emit1("matmul", [a, b])
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if alpha != 1.0:
        y = low.emit1("mul", [y, low.scalar(alpha, y)])
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = low.emit1("mul", [c, low.scalar(beta, c)])
        y = low.emit1("add", [y, c])
    return [y]


def _pads(low, attrs, spatial: int, in_shape, kernel, strides, dilations):
    """Padding before and after each spatial dim, from pads or auto_pad."""
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad in ("NOTSET", ""):
        pads = list(attrs.get("pads", [0] * (2 * spatial)))
    elif auto_pad == "VALID":
        pads = [0] * (2 * spatial)
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if symbols.free_symbols(list(in_shape)):
            refuse(low, f"auto_pad={auto_pad} over sizes known only per call {list(in_shape)}")
        begin, end = [], []
        for size, k, s, d in zip(in_shape, kernel, strides, dilations):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else big)
            end.append(big if auto_pad == "SAME_UPPER" else small)
        pads = begin + end
    else:
        refuse(low, f"auto_pad={auto_pad!r}")
    if len(pads) != 2 * spatial or any(p < 0 for p in pads):
        refuse(low, f"pads {pads} for {spatial} spatial dims")
    return pads[:spatial], pads[spatial:]


def _pad_unequal_part(low, x, begin: list, end: list, fill: float, most=None):
    """The IR's convolution and pooling pad both sides of a dim equally (pooling by at most
    half its window, `most`): `x` padded explicitly by the rest (with `fill`), and the
    padding both sides share, for the op's own."""
    shared = [min(b, e, m) for b, e, m in zip(begin, end, most or begin)]
    extra = {2 + i: (b - s, e - s) for i, (b, e, s) in enumerate(zip(begin, end, shared))
             if (b, e) != (s, s)}
    if extra:
        x = padding.pad(low.emit1, x, extra, "constant", fill)
    return x, shared


def _conv_operands(low, ins, what: str):
    """Input, weight, optional bias and the number of spatial dims (1 to 3) of a Conv or
    ConvTranspose."""
    x, w = ins[0], ins[1]
    need_float(low, x)
    spatial = x.type.rank - 2
    if spatial not in (1, 2, 3):
        refuse(low, f"{spatial}-d {what}")
    return x, w, (ins[2] if len(ins) > 2 else None), spatial


@handles("Conv")
def _conv(low, node, ins, attrs):
    x, w, bias, spatial = _conv_operands(low, ins, "convolution")
    kernel = list(attrs.get("kernel_shape", w.type.shape[2:]))
    strides = list(attrs.get("strides", [1] * spatial))
    dilations = list(attrs.get("dilations", [1] * spatial))
    begin, end = _pads(low, attrs, spatial, x.type.shape[2:], kernel, strides, dilations)
    x, padding = _pad_unequal_part(low, x, begin, end, 0.0)
    conv_attrs = {"stride": strides, "padding": padding, "dilation": dilations,
                  "groups": attrs.get("group", 1)}
    return [low.emit1("conv", [x, w] + ([bias] if bias is not None else []), conv_attrs)]


@handles("ConvTranspose")
def _conv_transpose(low, node, ins, attrs):
    """ConvTranspose as the IR's `conv_transpose` where its padding is torch's (equal on
    both sides, the extra output rows fewer than the stride or dilation); otherwise the
    whole transposed convolution without padding, then cropped or extended with zeros to
    the window ONNX asks for, then the bias."""
    x, w, bias, spatial = _conv_operands(low, ins, "transposed convolution")
    sizes = list(x.type.shape[2:])
    if symbols.free_symbols(sizes):
        refuse(low, f"a transposed convolution over sizes known only per call {sizes}")
    kernel = list(attrs.get("kernel_shape", w.type.shape[2:]))
    if kernel != list(w.type.shape[2:]):
        refuse(low, f"kernel_shape {kernel} differs from the weight's {list(w.type.shape[2:])}")
    strides = list(attrs.get("strides", [1] * spatial))
    dilations = list(attrs.get("dilations", [1] * spatial))
    extra = list(attrs.get("output_padding", [0] * spatial))[:spatial]
    full = [s * (n - 1) + (k - 1) * d + 1 for n, k, s, d in zip(sizes, kernel, strides, dilations)]
    auto_pad = attrs.get("auto_pad", "NOTSET") or "NOTSET"
    shape = attrs.get("output_shape")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER") and "pads" not in attrs:
        shape = list(shape[-spatial:]) if shape else [n * s for n, s in zip(sizes, strides)]
        total = [f + e - o for f, e, o in zip(full, extra, shape)]
        small = [t // 2 for t in total]
        begin = small if auto_pad == "SAME_UPPER" else [t - h for t, h in zip(total, small)]
    elif auto_pad in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        pads = list(attrs.get("pads", [0] * 2 * spatial)) if auto_pad != "VALID" \
            else [0] * 2 * spatial
        if len(pads) != 2 * spatial:
            refuse(low, f"pads {pads} for {spatial} spatial dims")
        begin = pads[:spatial]
        shape = list(shape[-spatial:]) if shape else \
            [f + e - b - a for f, e, b, a in zip(full, extra, begin, pads[spatial:])]
    else:
        refuse(low, f"auto_pad={auto_pad!r}")
    end = [o - (f - b) for o, f, b in zip(shape, full, begin)]  # < 0: cropped, > 0: added
    groups = attrs.get("group", 1)
    conv_attrs = {"stride": strides, "dilation": dilations, "groups": groups}
    # torch crops `begin` from both ends, then adds output_padding rows back at the end
    own_extra = [e + b for b, e in zip(begin, end)]
    if all(b >= 0 for b in begin) and all(0 <= o < max(s, d) for o, s, d in
                                          zip(own_extra, strides, dilations)):
        return [low.emit1("conv_transpose", [x, w] + ([bias] if bias is not None else []),
                          {**conv_attrs, "padding": begin, "output_padding": own_extra})]
    y = low.emit1("conv_transpose", [x, w], {**conv_attrs, "padding": [0] * spatial,
                                             "output_padding": [0] * spatial})
    y = padding.pad(low.emit1, y, {2 + i: (-b, e) for i, (b, e) in enumerate(zip(begin, end))},
                    "constant", 0.0)
    if bias is not None:
        per_channel = low.emit1("reshape", [bias], {"shape": [bias.type.shape[0]] + [1] * spatial})
        y = low.emit1("add", [y, per_channel])
    return [y]


def _pool_window(low, attrs, x):
    """The 2-d window of MaxPool or AveragePool: kernel, strides, dilations, padding
    before and after, and whether the IR's pooling takes that padding as its own (equal
    sides, at most half the window); refusing what it does not do exactly."""
    need_float(low, x)
    if x.type.rank != 4:
        refuse(low, f"{x.type.rank - 2}-d pooling (1-d and 2-d only)")
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1, 1]))
    dilations = list(attrs.get("dilations", [1, 1]))
    begin, end = _pads(low, attrs, 2, x.type.shape[2:], kernel, strides, dilations)
    if any(p >= (k - 1) * d + 1 for p, k, d in zip(begin + end, kernel * 2, dilations * 2)):
        refuse(low, f"padding {begin + end} as wide as the window {kernel} (dilations "
                    f"{dilations}): a window could hold padding only")
    own = begin == end and all(p <= k // 2 for p, k in zip(begin, kernel))
    if not own and attrs.get("ceil_mode", 0):
        refuse(low, f"ceil_mode=1 with padding {begin + end} the pooling cannot take as "
                    f"its own (unequal, or more than half the window {kernel})")
    return kernel, strides, dilations, begin, end, own


def _as_2d_pooling(pool):
    """A 1-d pooling (an [N, C, L] input) as the 2-d one over [N, C, 1, L]: the window
    attributes gain a leading unit axis, and the result drops it."""
    def handler(low, node, ins, attrs):
        x = ins[0]
        if x.type.rank != 3:
            return pool(low, node, ins, attrs)
        n, c, length = x.type.shape
        wide = {k: [1, *attrs[k]] for k in ("kernel_shape", "strides", "dilations")
                if k in attrs}
        if "pads" in attrs:
            wide["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][-1]]
        flat = low.emit1("reshape", [x], {"shape": [n, c, 1, length]})
        (y,) = pool(low, node, [flat] + list(ins[1:]), {**attrs, **wide})
        return [low.emit1("reshape", [y], {"shape": [n, c, y.type.shape[-1]]})]
    return handler


@handles("MaxPool")
@_as_2d_pooling
def _max_pool(low, node, ins, attrs):
    x = ins[0]
    if len([o for o in node.output if o]) > 1:
        refuse(low, "the Indices output")
    if attrs.get("storage_order", 0):
        refuse(low, "storage_order=1")
    kernel, strides, dilations, begin, end, _ = _pool_window(low, attrs, x)
    x, own = _pad_unequal_part(low, x, begin, end, -math.inf, [k // 2 for k in kernel])
    return [low.emit1("max_pool2d", [x], {"kernel": kernel, "stride": strides,
                                          "padding": own, "dilation": dilations,
                                          "ceil_mode": bool(attrs.get("ceil_mode", 0))})]


@handles("AveragePool")
@_as_2d_pooling
def _average_pool(low, node, ins, attrs):
    """ONNX's average pooling leaves the padding out of each window's count unless
    count_include_pad=1 (torch's default is the other way). Padding the IR's pooling
    cannot take is explicit zeros, so with count_include_pad=0 each output is then scaled
    by its window's share of input cells, computed at import."""
    x = ins[0]
    kernel, strides, dilations, begin, end, own = _pool_window(low, attrs, x)
    if dilations != [1, 1]:
        refuse(low, f"dilations {dilations}")
    include_pad = bool(attrs.get("count_include_pad", 0))
    window = {"kernel": kernel, "stride": strides, "padding": begin,
              "ceil_mode": bool(attrs.get("ceil_mode", 0)), "count_include_pad": include_pad}
    if own:
        return [low.emit1("avg_pool2d", [x], window)]
    if include_pad:
        x, window["padding"] = _pad_unequal_part(low, x, begin, end, 0.0,
                                                 [k // 2 for k in kernel])
        return [low.emit1("avg_pool2d", [x], window)]
    if symbols.free_symbols(list(x.type.shape[2:])):
        refuse(low, f"padding {begin + end} over sizes known only per call")
    counts = {2 + i: (b, e) for i, (b, e) in enumerate(zip(begin, end))}
    padded = padding.pad(low.emit1, x, counts, "constant", 0.0)
    pooled = low.emit1("avg_pool2d", [padded], {**window, "padding": [0, 0],
                                                "count_include_pad": True})
    ones = torch.nn.functional.pad(torch.ones([1, 1, *x.type.shape[2:]], dtype=torch.float64),
                                   [begin[1], end[1], begin[0], end[0]])
    share = torch.nn.functional.avg_pool2d(ones, kernel, strides)  # > 0: padding < window
    scale = low.constant((1.0 / share).to(x.type.dtype), "average_pool_scale")
    return [low.emit1("mul", [pooled, scale])]


@handles("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(low, node, ins, attrs):
    x = ins[0]
    need_float(low, x)
    dims = list(range(2, x.type.rank))
    if any(x.type.shape[d] == 0 for d in dims):
        refuse(low, "pooling over an empty window")
    op = "mean" if node.op_type == "GlobalAveragePool" else "amax"
    return [low.emit1(op, [x], {"dims": dims, "keepdim": True})]


@handles("BatchNormalization")
def _batch_norm(low, node, ins, attrs):
    if attrs.get("training_mode", 0) or len([o for o in node.output if o]) > 1:
        refuse(low, "training-mode batch normalization")
    x, scale, bias, mean, var = ins
    need_float(low, x)
    if len({v.type.dtype for v in ins}) != 1:
        refuse(low, "mixed element types")
    return [low.emit1("batch_norm", [x, scale, bias, mean, var],
                      {"eps": attrs.get("epsilon", 1e-5)})]


@handles("LayerNormalization")
def _layer_norm(low, node, ins, attrs):
    x, scale = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    need_float(low, x)
    axis = axis_of(low, attrs.get("axis", -1), x.type.rank)
    normalized = list(x.type.shape[axis:])
    wanted = len([o for o in node.output if o])
    if wanted > 1 and (x.type.dtype != torch.float32 or attrs.get("stash_type", 1) != 1):
        refuse(low, "Mean/InvStdDev outputs other than float32")
    ones = lambda: low.constant(torch.ones(normalized, dtype=x.type.dtype), "ones")
    zeros = lambda: low.constant(torch.zeros(normalized, dtype=x.type.dtype), "zeros")
    direct = list(scale.type.shape) == normalized and (
        bias is None or list(bias.type.shape) == normalized)
    weight = scale if direct else ones()
    shift = (bias if bias is not None else zeros()) if direct else zeros()
    out, mean, rstd = low.emit("layer_norm", [x, weight, shift],
                               {"normalized_shape": normalized, "eps": attrs.get("epsilon", 1e-5)})
    if not direct:
        out = low.emit1("mul", [out, scale])
        if bias is not None:
            out = low.emit1("add", [out, bias])
    return [out, mean, rstd]


@handles("Softmax", "LogSoftmax")
def _softmax(low, node, ins, attrs):
    x = ins[0]
    need_float(low, x)
    dim = axis_of(low, attrs.get("axis", -1), x.type.rank)
    op = "softmax" if node.op_type == "Softmax" else "log_softmax"
    return [low.emit1(op, [x], {"dim": dim})]


# -- reductions ------------------------------------------------------------------------------

_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "amax", "ReduceMin": "amin"}
# opset at which `axes` moved from an attribute to an input
_AXES_INPUT_SINCE = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18}


@handles(*_REDUCE)
def _reduce(low, node, ins, attrs):
    x = ins[0]
    if x.type.dtype not in FLOATS:
        refuse(low, f"{node.op_type} of {x.type.dtype}")
    if low.opset >= _AXES_INPUT_SINCE[node.op_type]:
        axes = low.ints(ins[1], "axes") if len(ins) > 1 and ins[1] is not None else []
    else:
        axes = list(attrs.get("axes", []))
    if not axes and attrs.get("noop_with_empty_axes", 0):
        return [x]
    dims = sorted({axis_of(low, a, x.type.rank) for a in axes}) if axes else list(range(x.type.rank))
    if any(x.type.shape[d] == 0 for d in dims) or (x.type.rank == 0):
        refuse(low, "reduction over an empty set or a scalar")
    return [low.emit1(_REDUCE[node.op_type], [x],
                      {"dims": dims, "keepdim": bool(attrs.get("keepdims", 1))})]
