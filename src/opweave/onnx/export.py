"""Writing an IR graph back as an ONNX model (opset 20) that onnx.checker accepts with
full shape inference and ONNX Runtime runs with the same results."""
from __future__ import annotations

import os

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from ..files import atomic_write_bytes
from ..ir import dtypes
from ..ir.graph import Graph, Node, Value
from .errors import OnnxError
from .importer import TORCH_TO_ONNX

OPSET = 20
IR_VERSION = 10


class OnnxExportError(OnnxError):
    """The graph has something ONNX (as opweave writes it) cannot express."""


def _np(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise OnnxExportError("bfloat16 constants are not exported yet")
    return tensor.detach().contiguous().numpy()


class _Writer:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.used = {v.name for v in graph.inputs} | {v.name for n in graph.nodes for v in n.outputs}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.names: dict[Value, str] = {}
        self._count = 0
        self.consumed = {v for n in graph.nodes for v in n.inputs} | set(graph.outputs)

    def fresh(self, hint: str) -> str:
        """A name no IR value and no earlier generated name has."""
        while True:
            self._count += 1
            name = f"{hint}__{self._count}"
            if name not in self.used:
                self.used.add(name)
                return name

    def name(self, value: Value) -> str:
        return self.names.setdefault(value, value.name)

    def const(self, array, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, values, hint="shape") -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), hint)

    def scalar(self, value, dtype: torch.dtype, hint="s") -> str:
        return self.const(torch.tensor(value, dtype=dtype).numpy(), hint)

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, **attrs) -> list[str]:
        outs = outputs if isinstance(outputs, list) else [self.fresh(op_type.lower())
                                                         for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(op_type), **attrs))
        return outs

    def op1(self, op_type, inputs, **attrs) -> str:
        return self.op(op_type, inputs, 1, **attrs)[0]

    def cast_to(self, name: str, have: torch.dtype, want: torch.dtype) -> str:
        return name if have == want else self.op1("Cast", [name], to=TORCH_TO_ONNX[want])


_UNARY = {"neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt",
          "reciprocal": "Reciprocal", "sigmoid": "Sigmoid", "tanh": "Tanh", "erf": "Erf",
          "relu": "Relu", "sin": "Sin", "cos": "Cos", "logical_not": "Not",
          "sign": "Sign", "ceil": "Ceil", "floor": "Floor"}
_ARITH = {"add": "Add", "sub": "Sub", "mul": "Mul", "pow": "Pow", "maximum": "Max",
          "minimum": "Min", "logical_and": "And", "logical_or": "Or"}
_COMPARE = {"eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater",
            "ge": "GreaterOrEqual", "ne": "Equal"}
_REDUCE = {"sum": "ReduceSum", "mean": "ReduceMean", "amax": "ReduceMax", "amin": "ReduceMin"}


def _operand_dtype(node: Node) -> torch.dtype:
    """The dtype torch computes a binary op in (0-d tensors promote like scalars)."""
    a, b = (torch.empty(v.type.shape, dtype=v.type.dtype, device="meta") for v in node.inputs)
    return torch.result_type(a, b)


def _write_node(w: _Writer, node: Node) -> None:
    ins = [w.name(v) for v in node.inputs]
    outs = [w.name(v) for v in node.outputs]
    a = node.attrs
    op = node.op
    out_type = node.outputs[0].type
    if op in _UNARY or op in _REDUCE or op in ("rsqrt", "log1p", "clamp"):
        # torch computes these in the output's type (an int exp is float, an int sum i64)
        ins[0] = w.cast_to(ins[0], node.inputs[0].type.dtype, out_type.dtype)
    if op in ("ceil", "floor") and out_type.dtype not in dtypes.FLOAT_DTYPES:
        w.op("Identity", ins, outs)  # ONNX rounds floats only; an integer is its own ceil
    elif op in _UNARY:
        w.op(_UNARY[op], ins, outs)
    elif op == "rsqrt":
        w.op("Reciprocal", [w.op1("Sqrt", ins)], outs)
    elif op == "log1p":
        w.op("Log", [w.op1("Add", [ins[0], w.scalar(1, out_type.dtype)])], outs)
    elif op == "gelu":
        w.op("Gelu", ins, outs, approximate=a["approximate"])
    elif op == "clamp":
        bounds = [w.scalar(a[k], out_type.dtype) if a[k] is not None else "" for k in ("min", "max")]
        w.op("Clip", ins + bounds, outs)
    elif op == "cast":
        w.op("Cast", ins, outs, to=TORCH_TO_ONNX[a["dtype"]])
    elif op in _ARITH or op == "div":
        args = [w.cast_to(n, v.type.dtype, out_type.dtype) for n, v in zip(ins, node.inputs)]
        if op == "pow" and out_type.dtype not in dtypes.FLOAT_DTYPES:
            _integer_pow(w, args, outs[0], out_type.dtype)
        elif op != "div":
            w.op(_ARITH[op], args, outs)
        elif a["rounding"] == "none" or (a["rounding"] == "trunc" and out_type.dtype not in dtypes.FLOAT_DTYPES):
            w.op("Div", args, outs)
        elif a["rounding"] == "floor" and out_type.dtype in dtypes.FLOAT_DTYPES:
            w.op("Floor", [w.op1("Div", args)], outs)
        elif a["rounding"] == "trunc":
            q = w.op1("Div", args)
            negative = w.op1("Less", [q, w.scalar(0, out_type.dtype)])
            w.op("Where", [negative, w.op1("Ceil", [q]), w.op1("Floor", [q])], outs)
        else:
            raise OnnxExportError(f"div with rounding {a['rounding']!r} on {out_type.dtype}")
    elif op in _COMPARE:
        common = _operand_dtype(node)
        args = [w.cast_to(n, v.type.dtype, common) for n, v in zip(ins, node.inputs)]
        if op == "ne":
            w.op("Not", [w.op1("Equal", args)], outs)
        else:
            w.op(_COMPARE[op], args, outs)
    elif op == "where":
        args = [ins[0]] + [w.cast_to(n, v.type.dtype, out_type.dtype)
                           for n, v in zip(ins[1:], node.inputs[1:])]
        w.op("Where", args, outs)
    elif op == "matmul":
        w.op("MatMul", ins, outs)
    elif op == "index_select":
        w.op("Gather", ins, outs, axis=a["dim"])
    elif op == "gather":
        w.op("GatherElements", ins, outs, axis=a["dim"])
    elif op == "scatter":
        if node.inputs[1].type.shape != node.inputs[2].type.shape:
            raise OnnxExportError(f"scatter with a source larger than its index ({outs[0]}); "
                                  f"ONNX ScatterElements needs equal shapes")
        w.op("ScatterElements", ins, outs, axis=a["dim"])
    elif op == "conv":
        w.op("Conv", ins, outs, strides=a["stride"], pads=list(a["padding"]) * 2,
             dilations=a["dilation"], group=a["groups"])
    elif op == "conv_transpose":
        w.op("ConvTranspose", ins, outs, strides=a["stride"], pads=list(a["padding"]) * 2,
             dilations=a["dilation"], group=a["groups"], output_padding=a["output_padding"])
    elif op in ("upsample_nearest2d", "upsample_bilinear2d"):
        _resize(w, node, ins[0], outs[0])
    elif op == "max_pool2d" and not a["with_indices"]:
        w.op("MaxPool", ins, outs, kernel_shape=a["kernel"], strides=a["stride"],
             pads=list(a["padding"]) * 2, dilations=a["dilation"], ceil_mode=int(a["ceil_mode"]))
    elif op == "avg_pool2d":
        w.op("AveragePool", ins, outs, kernel_shape=a["kernel"], strides=a["stride"],
             pads=list(a["padding"]) * 2, ceil_mode=int(a["ceil_mode"]),
             count_include_pad=int(a["count_include_pad"]))
    elif op == "adaptive_max_pool2d" and not a["with_indices"]:
        _adaptive_max_pool(w, node, ins[0], outs[0])
    elif op == "sparse_mm":
        _sparse_mm(w, node, ins, outs[0])
    elif op == "attention":
        _attention(w, node, ins, outs[0])
    elif op in _REDUCE:
        w.op(_REDUCE[op], [ins[0], w.ints(a["dims"], "axes")], outs, keepdims=int(a["keepdim"]))
    elif op == "any":
        as_int = w.op1("Cast", ins, to=onnx.TensorProto.INT32)
        reduced = w.op1("ReduceMax", [as_int, w.ints(a["dims"], "axes")], keepdims=int(a["keepdim"]))
        # over an empty set ReduceMax gives INT32_MIN; "> 0" makes that False, as torch
        w.op("Greater", [reduced, w.const(np.array(0, np.int32), "zero")], outs)
    elif op in ("softmax", "log_softmax"):
        w.op("Softmax" if op == "softmax" else "LogSoftmax", ins, outs, axis=a["dim"])
    elif op == "layer_norm":
        axis = node.inputs[0].type.rank - len(a["normalized_shape"])
        dtype = node.inputs[0].type.dtype
        # ONNX computes in `stash_type` (float32 unless told) and types Mean/InvStdDev so
        stash = onnx.TensorProto.DOUBLE if dtype == torch.float64 else onnx.TensorProto.FLOAT
        if dtype in (torch.float16, torch.bfloat16) and any(
                v in w.consumed for v in node.outputs[1:]):
            raise OnnxExportError(f"layer_norm {outs[0]}: half-precision mean/rstd outputs")
        w.op("LayerNormalization", ins, outs, axis=axis, epsilon=a["eps"], stash_type=stash)
    elif op == "batch_norm":
        w.op("BatchNormalization", ins, outs, epsilon=a["eps"])
    elif op == "reshape":  # allowzero: a 0 in the target means size 0, as in the IR
        w.op("Reshape", [ins[0], w.ints(a["shape"])], outs,
             **({"allowzero": 1} if 0 in a["shape"] else {}))
    elif op == "permute" and out_type.rank == 0:  # ONNX cannot type an empty perm
        w.op("Identity", ins, outs)
    elif op == "permute":
        w.op("Transpose", ins, outs, perm=[d % max(out_type.rank, 1) for d in a["dims"]])
    elif op == "expand":
        w.op("Expand", [ins[0], w.ints(a["shape"])], outs)
    elif op == "slice":
        size = node.inputs[0].type.shape[a["dim"]]
        end = min(a["end"], size)
        w.op("Slice", [ins[0], w.ints([a["start"]], "starts"), w.ints([end], "ends"),
                       w.ints([a["dim"]], "axes"), w.ints([a["step"]], "steps")], outs)
    elif op == "cat":
        args = [n for n, v in zip(ins, node.inputs) if v.type.numel or len(ins) == 1] or ins[:1]
        w.op("Concat", args, outs, axis=a["dim"] % out_type.rank)
    elif op in ("full", "arange"):
        tensor = node.opdef.impl(**a)
        w.op("Identity", [w.const(_np(tensor), op)], outs)
    else:
        raise OnnxExportError(f"IR op {op!r} has no ONNX form in opweave's exporter "
                              f"(node {outs[0]})")


def _integer_pow(w: _Writer, args: list[str], out: str, dtype: torch.dtype) -> None:
    """torch's integer power gives 0 for 0 to a negative power; ONNX's Pow (a float power
    truncated back, in the reference) gives the cast of infinity. Elsewhere they agree."""
    base, exponent = args
    zero = w.scalar(0, dtype, "zero")
    undefined = w.op1("And", [w.op1("Equal", [base, zero]), w.op1("Less", [exponent, zero])])
    w.op("Where", [undefined, zero, w.op1("Pow", args)], [out])


def _resize(w: _Writer, node: Node, x: str, out: str) -> None:
    """Upsampling as Resize: nearest as torch's (asymmetric coordinates, rounded down),
    bilinear with torch's half-pixel or align-corners coordinates; the factors the user
    gave where torch's kernel uses them, else the output sizes."""
    a = node.attrs
    n, c, h, w_in = node.inputs[0].type.shape
    factors = np.array([a["scales_h"] or 0, a["scales_w"] or 0], np.float32)
    # ONNX sizes its output from the factors rounded to float32, torch from the float64 ones
    if a["scales_h"] is not None and a["scales_w"] is not None and \
            not a.get("align_corners", False) and \
            list(np.floor(factors.astype(np.float64) * [h, w_in])) == list(a["size"]):
        scales = w.const(np.concatenate([np.ones(2, np.float32), factors]), "resize_scales")
        inputs = [x, "", scales]  # output sizes floor(in * factor), as torch's
    else:
        inputs = [x, "", "", w.ints([n, c, *a["size"]], "resize_sizes")]
    if node.op == "upsample_nearest2d":
        w.op("Resize", inputs, [out], mode="nearest", nearest_mode="floor",
             coordinate_transformation_mode="asymmetric")
    else:
        mode = "align_corners" if a["align_corners"] else "half_pixel"
        w.op("Resize", inputs, [out], mode="linear", coordinate_transformation_mode=mode)


def _adaptive_max_pool(w: _Writer, node: Node, x: str, out: str) -> None:
    """Each axis in turn: gather every window's positions, then the max over them
    (max is separable, so rows then columns gives the window maximum)."""
    from ..ir.ops.nn import chunk_positions

    if 0 in node.attrs["output_size"] or 0 in node.inputs[0].type.shape[-2:]:
        # no window to gather (found by opweave fuzz: it crashed with a bare ValueError)
        raise OnnxExportError(f"adaptive max pooling over or to an empty axis has no ONNX "
                              f"form in opweave's exporter (node {out})")
    shape = node.inputs[0].type.shape
    current = x
    for axis, size in zip((-2, -1), node.attrs["output_size"]):
        rank = len(shape)
        dim = rank + axis
        positions = chunk_positions(shape[dim], size).numpy()
        gathered = w.op1("Gather", [current, w.const(positions, "windows")], axis=dim)
        current = w.op1("ReduceMax", [gathered, w.ints([dim + 1], "axes")], keepdims=0)
    w.op("Identity", [current], [out])


def _sparse_mm(w: _Writer, node: Node, ins: list[str], out: str) -> None:
    """COO sparse x dense: gather the dense rows of each column index, scale by the values,
    and scatter-add them into the output rows."""
    indices, values, dense = ins
    rows_cols = node.attrs["rows"], node.attrs["cols"]
    width = node.inputs[2].type.shape[1]
    dtype = node.outputs[0].type.dtype
    row = w.op1("Gather", [indices, w.const(np.array([0], np.int64), "row")], axis=0)  # [1, nnz]
    col = w.op1("Gather", [indices, w.const(np.array(1, np.int64), "col")], axis=0)  # [nnz]
    picked = w.op1("Gather", [dense, col], axis=0)  # [nnz, width]
    scale = w.op1("Unsqueeze", [w.cast_to(values, node.inputs[1].type.dtype, dtype),
                                w.ints([1], "axes")])
    updates = w.op1("Mul", [picked, scale])
    zeros = w.const(np.zeros((rows_cols[0], width), dtype=torch.empty(0, dtype=dtype).numpy().dtype), "zeros")
    w.op("ScatterND", [zeros, w.op1("Transpose", [row], perm=[1, 0]), updates], [out],
         reduction="add")


def _attention(w: _Writer, node: Node, ins: list[str], out: str) -> None:
    """The fused attention in its math form: softmax(scale q k^T, masked) v."""
    q, k, v = ins[:3]
    length, source = node.inputs[0].type.shape[2], node.inputs[1].type.shape[2]
    dtype = node.outputs[0].type.dtype
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    scores = w.op1("Mul", [w.op1("MatMul", [q, w.op1("Transpose", [k], perm=[0, 1, 3, 2])]),
                           w.const(np.array(node.attrs["scale"], np_dtype), "scale")])
    minus_inf = w.const(np.array(-np.inf, np_dtype), "minus_inf")
    if node.attrs["causal"]:
        keep = w.const(np.tril(np.ones((length, source), dtype=bool)), "causal")
        scores = w.op1("Where", [keep, scores, minus_inf])
    if len(ins) == 4:
        if node.inputs[3].type.dtype == torch.bool:
            scores = w.op1("Where", [ins[3], scores, minus_inf])
        else:
            scores = w.op1("Add", [scores, ins[3]])
    w.op("MatMul", [w.op1("Softmax", [scores], axis=-1), v], [out])


def _value_info(name: str, value: Value) -> onnx.ValueInfoProto:
    try:
        elem = TORCH_TO_ONNX[value.type.dtype]
    except KeyError:
        raise OnnxExportError(f"value {value.name} has dtype {value.type.dtype}") from None
    return helper.make_tensor_value_info(name, elem, list(value.type.shape))


def to_onnx_model(graph: Graph, *, check: bool = True) -> onnx.ModelProto:
    """The ONNX model of `graph`; checked with onnx.checker (full shape inference)."""
    w = _Writer(graph)
    for node in graph.nodes:
        if node.op == "constant":
            tensor = graph.constants[node.attrs["name"]]
            name = w.name(node.outputs[0])
            w.initializers.append(numpy_helper.from_array(_np(tensor), name))
        else:
            _write_node(w, node)
    inputs = [_value_info(w.name(v), v) for v in graph.inputs]
    outputs, seen = [], set()
    for i, value in enumerate(graph.outputs):
        name = w.name(value)
        if name in seen or value in graph.inputs or (value.producer and value.producer.op == "constant"):
            alias = f"output_{i}"
            w.op("Identity", [name], [alias])
            name = alias
        seen.add(name)
        outputs.append(_value_info(name, value))
    onnx_graph = helper.make_graph(w.nodes, graph.name, inputs, outputs, w.initializers)
    model = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="opweave", ir_version=IR_VERSION)
    if check:
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as error:
            raise OnnxExportError(f"the exported model fails onnx.checker: {error}") from None
    return model


def export(source, path: "str | os.PathLike | None" = None) -> onnx.ModelProto:
    """`opweave.to_onnx`: an IR Graph, a compiled model (torch path) or an OnnxModel
    (its graph for the declared shapes) as a checked ONNX model, saved when `path` is given."""
    graph = _graph_of(source)
    model = to_onnx_model(graph)
    if path is not None:
        atomic_write_bytes(path, model.SerializeToString())
    return model


def _graph_of(source) -> Graph:
    if isinstance(source, Graph):
        return source
    graphs = getattr(source, "graphs", None)  # a CompiledModel's IR segments
    if graphs is not None:
        if len(graphs) != 1:
            raise OnnxExportError(f"the compiled model has {len(graphs)} IR segments (parts fell "
                                  f"back to eager); only a whole-model graph can be exported")
        return graphs[0]
    if hasattr(source, "graph") and callable(source.graph):
        return source.graph()
    raise TypeError(f"cannot export a {type(source).__name__}; pass an IR Graph or a compiled model")
