"""Lowering ATen-level FX nodes into the IR.

`LoweringContext` holds the IR graph under construction and the map from FX nodes to IR
values. The per-op rules live in `aten`; this module holds what they share: turning
FX arguments into IR values, scalar constants, and the `Unsupported` signal that sends a
node to eager PyTorch instead.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir import Graph, TensorType, Value, dtypes, provenance, symbols


class Unsupported(Exception):
    """This node (or this use of an op) has no IR lowering; it will run in eager PyTorch."""


LoweringFn = Callable[..., Any]
TABLE: dict[Any, LoweringFn] = {}


def lowers(*targets):
    """Register a lowering rule for one or more ATen overloads."""

    def wrap(fn: LoweringFn) -> LoweringFn:
        for target in targets:
            TABLE[target] = fn
        return fn

    return wrap


def fx_value(node: fx.Node):
    """The example value of an FX node: a (fake) tensor, a tuple of them, or a number."""
    if "val" in node.meta:
        return node.meta["val"]
    if "example_value" in node.meta:
        return node.meta["example_value"]
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return torch.empty(meta.shape, dtype=meta.dtype, device="meta")
    raise Unsupported(f"no shape information on FX node {node.name}")


def tensor_type(example) -> TensorType:
    """The IR type of an example tensor; Unsupported for what the IR cannot carry."""
    if not isinstance(example, torch.Tensor):
        raise Unsupported(f"expected a tensor, got {type(example).__name__}")
    if example.layout != torch.strided:
        raise Unsupported(f"{example.layout} tensors are not IR values")
    if example.device.type not in ("cpu", "meta", "cuda"):
        raise Unsupported(f"tensors on {example.device} are not supported yet")
    if not dtypes.is_supported(example.dtype):
        raise Unsupported(f"dtype {example.dtype} is not supported")
    try:
        return TensorType(tuple(symbols.dim(d) for d in example.shape), example.dtype)
    except symbols.SymbolError as err:
        raise Unsupported(f"a shape the IR cannot carry: {err}") from None


SIZE_TYPES = (int, torch.SymInt)


def is_size(node) -> bool:
    """Whether an FX node computes a size (an int or a torch.SymInt), not a tensor."""
    if not isinstance(node, fx.Node):
        return False
    value = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(value, SIZE_TYPES) and not isinstance(value, bool)


def with_sizes(args, kwargs):
    """A node's arguments with every size-valued FX node replaced by its dimension
    (ir.symbols): the rules see `s0*128` where the graph computes it."""
    def size(n: fx.Node):
        return symbols.dim(fx_value(n)) if is_size(n) else n
    return fx.node.map_arg(args, size), fx.node.map_arg(kwargs, size)


class LoweringContext:
    """Builds one IR graph from FX nodes. `constants` maps FX nodes that stand for
    constant tensors (parameters and buffers when freezing, get_attr) to their data."""

    def __init__(self, graph: Graph, constants: dict[fx.Node, torch.Tensor]):
        self.graph = graph
        self.constants = constants
        self.values: dict[fx.Node, Any] = {}
        self.node: fx.Node | None = None  # the FX node being lowered (for rules that look at users)
        self._scalars: dict[tuple, Value] = {}

    def value(self, node: fx.Node) -> Value:
        """The IR value standing for an FX node's tensor."""
        if node not in self.values:
            if node in self.constants:
                data = self.constants[node]
                tensor_type(data)
                self.values[node] = self.graph.add_constant(_const_name(node), data,
                                                            source=node.name)
            else:
                raise Unsupported(f"FX node {node.name} has no IR value")
        value = self.values[node]
        if not isinstance(value, Value):
            raise Unsupported(f"FX node {node.name} is not a single tensor")
        return value

    def constant_tensor(self, node) -> torch.Tensor | None:
        return self.constants.get(node) if isinstance(node, fx.Node) else None

    def scalar(self, number, like: Value | None = None, dtype: torch.dtype | None = None) -> Value:
        """A 0-d constant for a Python number, typed as torch would promote it against `like`."""
        if isinstance(number, torch.SymInt | torch.SymFloat | torch.SymBool):
            raise Unsupported("symbolic scalars are not supported yet")
        if dtype is None:
            if like is not None:
                # promotion against a Python number depends on the dtype and on whether
                # the tensor has dimensions, never on their sizes (which may be symbols)
                shape = (1,) * min(len(like.type.shape), 1)
                dtype = torch.result_type(torch.empty(shape, dtype=like.type.dtype,
                                                      device="meta"), number)
            else:
                dtype = torch.tensor(number).dtype
        key = (type(number), repr(number), dtype)
        if key not in self._scalars:
            data = torch.tensor(number, dtype=dtype)
            self._scalars[key] = self.graph.add_constant(f"scalar_{dtypes.name_of(dtype)}", data)
        return self._scalars[key]

    def add(self, op: str, inputs, attrs=None) -> list[Value]:
        return self.graph.add(op, inputs, attrs, name=self._hint(), source=self._source())

    def add1(self, op: str, inputs, attrs=None) -> Value:
        return self.graph.add1(op, inputs, attrs, name=self._hint(), source=self._source())

    def _hint(self) -> str:
        return self.node.name if self.node is not None else ""

    def _source(self) -> str:
        if self.node is None:
            return ""
        return source_of(self.node)


def source_of(node: fx.Node) -> str:
    """A short provenance string (ir.provenance): the FX node, the innermost source line
    outside torch itself (`nn.Linear.forward` is not where the user wrote the layer) and
    the module it ran in."""
    frame = ""
    stack = node.meta.get("stack_trace")
    if stack:
        frames = [line.strip() for line in stack.strip().splitlines() if line.strip().startswith("File")]
        # torch's own frames, and code it generated (`<eval_with_key>`: what AOTAutograd's
        # joint graphs record instead of the user's lines), say nothing of the model
        outside = [f for f in frames if _TORCH_DIR not in f and not f.startswith('File "<')]
        if outside:
            frame = outside[-1]
    return provenance.describe(node.name, frame, provenance.module_path(node.meta.get("nn_module_stack")))


_TORCH_DIR = str(Path(torch.__file__).parent) + "/"


def _const_name(node: fx.Node) -> str:
    target = node.target if node.op == "get_attr" else node.name
    return str(target)
