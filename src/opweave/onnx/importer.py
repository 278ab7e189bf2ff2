"""Lowering an ONNX graph, specialized to concrete input shapes, into the opweave IR.

Nodes may come in any order (they are sorted, and a cycle is named). Values known at import
time (initializers, Constant nodes, shapes, and whatever is computed only from those) are
folded as they are built, so shape computations (Shape -> Gather -> Concat -> Reshape)
become the constant attributes the IR needs.

With symbolic input dims (`dim_param`s), a Shape gives sizes over symbols: such a value is
kept at import time as an array of dimensions (`Lowering.symbolic_value`), folded through
the shape arithmetic after it (`symbolic_folds`), and read where a shape is needed (a
Reshape's target, an Expand's shape, a Range's bound), so those become symbolic
attributes. An op that reads it as data cannot be lowered symbolically (OnnxUnsupported;
the model is then lowered per shape).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..ir import dtypes, registry, symbols
from ..ir.graph import Graph, Value
from ..ir.types import TensorType
from .errors import OnnxError, OnnxUnsupported, where
from .symbolic_folds import fold_symbolic

# ONNX element type -> torch dtype, for the types the IR has
ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16, onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8, onnx.TensorProto.BOOL: torch.bool,
}
TORCH_TO_ONNX = {v: k for k, v in ONNX_TO_TORCH.items()}
FOLD_LIMIT = 1 << 16  # fold computed values up to this many elements; larger stay nodes


def torch_dtype(onnx_type: int, what: str) -> torch.dtype:
    try:
        return ONNX_TO_TORCH[onnx_type]
    except KeyError:
        name = onnx.TensorProto.DataType.Name(onnx_type) if onnx_type in onnx.TensorProto.DataType.values() else onnx_type
        raise OnnxUnsupported(f"{what} has element type {name}, which opweave does not support") from None


def tensor_from_proto(proto: onnx.TensorProto, what: str) -> torch.Tensor:
    dtype = torch_dtype(proto.data_type, what)
    if any(d < 0 for d in proto.dims):
        raise OnnxError(f"{what}: tensor {proto.name!r} has negative dims {list(proto.dims)}")
    if proto.HasField("raw_data"):
        expected = math.prod(proto.dims) * dtype.itemsize
        if len(proto.raw_data) != expected:
            raise OnnxError(f"{what}: raw data of tensor {proto.name!r} has "
                            f"{len(proto.raw_data)} bytes, but its dims {list(proto.dims)} of "
                            f"{str(dtype).removeprefix('torch.')} need {expected}")
    try:
        array = numpy_helper.to_array(proto)
    except Exception as error:
        raise OnnxError(f"{what}: cannot decode tensor {proto.name!r}: {error}") from None
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16).astype(np.int32)
                                << 16).view(torch.float32).to(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True)).to(dtype)


def decode_initializers(model: onnx.ModelProto) -> dict[str, torch.Tensor]:
    """The graph's initializers as tensors, decoded once and shared by every
    specialization (constants are stored, not copied)."""
    return {init.name: tensor_from_proto(init, f"initializer {init.name!r}")
            for init in model.graph.initializer}


@dataclass(frozen=True)
class DeclaredInput:
    """A graph input as declared: element type and dims (int, a symbol name, or None)."""

    name: str
    dtype: torch.dtype
    dims: tuple | None  # None: rank unknown


def declared_inputs(graph: onnx.GraphProto) -> list[DeclaredInput]:
    initializers = {t.name for t in graph.initializer}
    result = []
    for value in graph.input:
        if value.name in initializers:
            continue  # an old-style input with a default: a constant here
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            raise OnnxUnsupported(f"graph input {value.name!r} is a {kind}, not a tensor")
        tensor_type = value.type.tensor_type
        dtype = torch_dtype(tensor_type.elem_type, f"graph input {value.name!r}")
        dims = None
        if tensor_type.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else
                         (d.dim_param or None) for d in tensor_type.shape.dim)
        result.append(DeclaredInput(value.name, dtype, dims))
    return result


def topological_order(graph: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """The nodes in an order where every input is produced first; names what is wrong
    when no such order exists (an undefined input, or a cycle)."""
    producers: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                if out in producers or out in available:
                    raise OnnxError(f"value {out!r} is produced twice (by {where(node)})")
                producers[out] = i
    waiting = {}
    for i, node in enumerate(graph.node):
        deps = set()
        for name in node.input:
            if not name or name in available:
                continue
            if name not in producers:
                raise OnnxError(f"{where(node)} reads {name!r}, which no node produces and is "
                                f"neither a graph input nor an initializer")
            deps.add(producers[name])
        waiting[i] = deps
    users: dict[int, list[int]] = {i: [] for i in waiting}
    for i, deps in waiting.items():
        for d in deps:
            users[d].append(i)
    ready = [i for i, deps in waiting.items() if not deps]
    order = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for u in users[i]:
            waiting[u].discard(i)
            if not waiting[u]:
                ready.append(u)
    if len(order) != len(graph.node):
        stuck = [where(graph.node[i]) for i in sorted(set(waiting) - set(order))][:5]
        raise OnnxError(f"the graph has a cycle through {', '.join(stuck)}")
    return [graph.node[i] for i in order]


# Operator inputs that must be known to lower the node (shapes, axes, bounds).
CONSTANT_INPUTS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Squeeze": (1,),
                   "Unsqueeze": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
                   "ReduceMin": (1,), "Split": (1,), "ConstantOfShape": (0,),
                   "Range": (0, 1, 2), "Dropout": (1, 2), "Pad": (1, 2, 3),
                   "Resize": (1, 2, 3), "Upsample": (1,)}


def value_inputs(graph: onnx.GraphProto) -> set[str]:
    """Graph inputs read where a node needs a known value (a Reshape's shape, a Slice's
    starts): the model is specialized to their values at run time, as to input shapes."""
    names = {d.name for d in declared_inputs(graph)}
    found = set()
    for node in graph.node:
        for position in CONSTANT_INPUTS.get(node.op_type, ()):
            if position < len(node.input) and node.input[position] in names:
                found.add(node.input[position])
    return found


Handler = Callable[["Lowering", onnx.NodeProto, list, dict], list]
HANDLERS: dict[str, Handler] = {}


def handles(*op_types: str):
    def register(fn: Handler) -> Handler:
        for op_type in op_types:
            HANDLERS[op_type] = fn
        return fn
    return register


def attributes(node: onnx.NodeProto) -> dict:
    result = {}
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR:
            result[attr.name] = attr.t
        elif attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
            raise OnnxUnsupported(f"{where(node)} has a subgraph attribute {attr.name!r} "
                                  f"(control flow is not supported)")
        else:
            value = onnx.helper.get_attribute_value(attr)
            result[attr.name] = value.decode() if isinstance(value, bytes) else value
    return result


class Lowering:
    """The state of one lowering: the IR graph being built and the ONNX name -> Value map."""

    def __init__(self, model: onnx.ModelProto, opset: int, name: str = "onnx",
                 initializers: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.opset = opset
        self.initializers = initializers if initializers is not None else decode_initializers(model)
        self.graph = Graph(name)
        self.values: dict[str, Value] = {}
        self.node: onnx.NodeProto | None = None
        # values known at import time as sizes over symbols (never tensors of the graph)
        self.symbolic: dict[Value, np.ndarray] = {}

    # -- building, with folding ---------------------------------------------------------
    def constant(self, tensor: torch.Tensor, hint: str = "const") -> Value:
        if not dtypes.is_supported(tensor.dtype):
            raise OnnxUnsupported(f"constant {hint!r} has dtype {tensor.dtype}")
        return self.graph.add_constant(hint, tensor, source=self._source())

    def const_of(self, value: Value | None) -> torch.Tensor | None:
        """The data of `value` if it is known at import time."""
        if value is not None and value.producer is not None and value.producer.op == "constant":
            return self.graph.constants[value.producer.attrs["name"]]
        return None

    def require_const(self, value: Value | None, what: str) -> torch.Tensor:
        data = self.const_of(value)
        if data is None:
            raise OnnxUnsupported(f"{where(self.node)}: {what} must be known when the model is "
                                  f"imported (a constant or computed from shapes)")
        return data

    def ints(self, value: Value | None, what: str) -> list:
        """The integers of a value known at import time; sizes over symbols where it was
        computed from symbolic dims."""
        if value in self.symbolic:
            return list(self.symbolic[value].reshape(-1))
        return [int(v) for v in self.require_const(value, what).reshape(-1).tolist()]

    def symbolic_value(self, data: np.ndarray, hint: str = "shape") -> Value:
        """An int64 value whose elements are dimensions (ints or expressions over
        symbols): a constant when every one is an int, else known only here."""
        data = np.vectorize(symbols.dim, otypes=[object])(data) if data.size else data
        if not any(symbols.is_symbolic(d) for d in data.flat):
            return self.constant(torch.tensor(data.astype(np.int64)), hint)
        value = Value(f"{hint}_symbolic", TensorType(data.shape, torch.int64))
        self.symbolic[value] = data
        return value

    def known(self, value: Value | None) -> np.ndarray | None:
        """An integer value known at import time as an object array (of dimensions)."""
        if value in self.symbolic:
            return self.symbolic[value]
        data = self.const_of(value)
        if data is None or data.dtype.is_floating_point or data.dtype == torch.bool \
                or data.numel() > FOLD_LIMIT:
            return None
        return np.array(data.tolist(), dtype=object).reshape(tuple(data.shape))

    def emit(self, op: str, inputs: list[Value], attrs: dict | None = None) -> list[Value]:
        """Add an IR node, or fold it when all its inputs are known and it is small."""
        opdef = registry.get(op)
        try:
            full = opdef.full_attrs(attrs or {})
            types = opdef.infer([v.type for v in inputs], full)
        except (registry.ShapeError, ValueError, TypeError) as error:
            # a model whose shapes do not fit, or a handler bug: never "unsupported"
            raise OnnxError(f"{where(self.node)}: {op} does not accept "
                            f"{[str(v.type) for v in inputs]} with {attrs}: {error}") from None
        if any(v in self.symbolic for v in inputs):
            arrays = [self.known(v) for v in inputs]
            folded = fold_symbolic(op, arrays, full) if all(a is not None for a in arrays) \
                else None
            if folded is None:
                raise OnnxUnsupported(f"{where(self.node)}: {op} reads a shape computed from "
                                      f"symbolic sizes as data")
            return [self.symbolic_value(folded, op)]
        known = [self.const_of(v) for v in inputs]
        if (op != "constant" and not opdef.is_random and all(k is not None for k in known)
                and all(t.is_static and t.numel <= FOLD_LIMIT for t in types)):
            outs = opdef.impl(*known, **full)
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return [self.constant(o.clone(), op) for o in outs]
        return self.graph.add(op, inputs, attrs, name=op, source=self._source())

    def emit1(self, op: str, inputs: list[Value], attrs: dict | None = None) -> Value:
        return self.emit(op, inputs, attrs)[0]

    def scalar(self, value, like: Value) -> Value:
        return self.constant(torch.tensor(value, dtype=like.type.dtype), "scalar")

    def _source(self) -> str:
        node = self.node
        if node is None:
            return "onnx"
        return f"onnx:{node.name or node.op_type}"

    # -- the whole graph ----------------------------------------------------------------
    def lower(self, input_types: dict[str, TensorType],
              input_values: dict[str, torch.Tensor] | None = None) -> Graph:
        """The IR graph for these input types; inputs in `input_values` (shape-like inputs,
        see `value_inputs`) become constants of this specialization."""
        onnx_graph = self.model.graph
        input_values = input_values or {}
        for declared in declared_inputs(onnx_graph):
            if declared.name in input_values:  # cloned: the caller may reuse its array
                self.values[declared.name] = self.constant(input_values[declared.name].clone(),
                                                           declared.name)
            else:
                self.values[declared.name] = self.graph.add_input(declared.name,
                                                                  input_types[declared.name])
        for name, tensor in self.initializers.items():
            self.values[name] = self.constant(tensor, name)
        for node in topological_order(onnx_graph, set(self.values)):
            self.node = node
            self._lower_node(node)
        self.node = None
        outputs = []
        for out in onnx_graph.output:
            if out.name not in self.values:
                raise OnnxError(f"graph output {out.name!r} is not produced by any node")
            outputs.append(self.values[out.name])
        self.graph.outputs = outputs
        self.graph.remove_dead()
        return self.graph

    def _lower_node(self, node: onnx.NodeProto) -> None:
        if node.domain not in ("", "ai.onnx"):
            raise OnnxUnsupported(f"{where(node)}: operator domain {node.domain!r} is not supported")
        handler = HANDLERS.get(node.op_type)
        if handler is None:
            raise OnnxUnsupported(f"{where(node)}: ONNX operator {node.op_type!r} is not supported")
        inputs = [self.values[name] if name else None for name in node.input]
        outputs = handler(self, node, inputs, attributes(node))
        for position, name in enumerate(node.output):
            if not name:
                continue  # an optional output nobody asked for
            if position >= len(outputs) or outputs[position] is None:
                raise OnnxUnsupported(f"{where(node)}: output {position} ({name!r}) is not "
                                      f"supported")
            self.values[name] = outputs[position]
