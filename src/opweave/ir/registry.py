"""The op registry: each op declares, once, everything the compiler needs to know about it.

An `OpDef` holds the op's attributes, its shape rule and dtype rule, its DNNFusion mapping
type, its cost formula and a reference implementation on torch tensors. Every stage reads
ops from here; nothing else in opweave knows op semantics.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch

from . import symbols
from .types import TensorType


class MappingType(enum.Enum):
    """DNNFusion's classification of how output elements depend on input elements."""

    ONE_TO_ONE = "one-to-one"      # elementwise: out[i] depends on in[i]
    ONE_TO_MANY = "one-to-many"    # an input element feeds many outputs: expand, gather
    MANY_TO_MANY = "many-to-many"  # GEMM, conv, reductions, softmax, norms
    REORGANIZE = "reorganize"      # same elements, new shape: reshape
    SHUFFLE = "shuffle"            # same elements, new order: permute, slice, cat


@dataclass(frozen=True)
class Cost:
    """What an op costs: arithmetic and the memory traffic of an unfused execution."""

    flops: int
    bytes: int

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


# An attribute's kind; values are checked against it by the verifier.
ATTR_KINDS = {
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "str": (str,),
    "ints": (list, tuple),
    "dtype": (torch.dtype,),
    "optional_int": (int, type(None)),
    "optional_float": (float, int, type(None)),
    "scalar": (bool, int, float),
}

REQUIRED = object()


@dataclass(frozen=True)
class Attr:
    kind: str
    default: Any = REQUIRED

    def check(self, value) -> bool:
        if self.kind not in ("bool", "scalar") and isinstance(value, bool):
            return False
        if self.kind in ("int", "optional_int", "scalar") and symbols.is_symbolic(value):
            return True  # a size known only when the graph is called
        if not isinstance(value, ATTR_KINDS[self.kind]):
            return False
        if self.kind == "ints":
            return all(isinstance(v, int) and not isinstance(v, bool) or symbols.is_symbolic(v)
                       for v in value)
        return True


Types = Sequence[TensorType]


def default_bytes(inputs: Sequence[TensorType], outputs: Sequence[TensorType], attrs) -> int:
    return sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)


@dataclass
class OpDef:
    """One IR op. `shape_rule` and `dtype_rule` map the input types (and attrs) to the
    output shapes and dtypes (rules see whole types: torch's promotion depends on rank);
    `flops` maps input and output types to arithmetic operations;
    `impl` computes the outputs on torch tensors (the reference every backend must match)."""

    name: str
    num_inputs: int | None  # None: variadic
    attrs: dict[str, Attr]
    shape_rule: Callable[[Types, dict], list[tuple[int, ...]]]
    dtype_rule: Callable[[Types, dict], list[torch.dtype]]
    mapping: MappingType
    flops: Callable[[Sequence[TensorType], Sequence[TensorType], dict], int]
    impl: Callable[..., Any]
    doc: str = ""
    # Ops whose output may alias an input (views). The executor and memory plan honour it.
    is_view: bool = False
    # `impl_out(inputs, attrs, out)` writes the single output into a preallocated tensor.
    impl_out: Callable[..., None] | None = None
    # Random ops (dropout) must not be deduplicated or constant-folded.
    is_random: bool = False

    def full_attrs(self, attrs: dict) -> dict:
        """The attributes with defaults filled in; raises on unknown or missing ones."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise ValueError(f"op {self.name}: unknown attribute(s) {sorted(unknown)}")
        out = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                value = attrs[key]
                out[key] = _canonical(list(value) if isinstance(value, tuple) else value)
            elif spec.default is REQUIRED:
                raise ValueError(f"op {self.name}: missing attribute {key!r}")
            else:
                out[key] = spec.default
        return out

    def infer(self, inputs: Sequence[TensorType], attrs: dict) -> list[TensorType]:
        try:
            shapes = self.shape_rule(inputs, attrs)
        except TypeError as err:
            # sympy cannot decide a comparison of symbols ("is s0 - 2 > 0?"): the rule
            # needs concrete sizes, so this use of the op cannot be symbolic
            if all(t.is_static for t in inputs) and not symbols.free_symbols(attrs.values()):
                raise
            raise ShapeError(f"op {self.name}: its shape rule needs concrete sizes "
                             f"here ({str(err).splitlines()[0]})") from None
        dts = self.dtype_rule(inputs, attrs)
        if len(shapes) != len(dts):
            raise AssertionError(f"op {self.name}: shape and dtype rules disagree on output count")
        try:
            return [TensorType(tuple(symbols.dim(d) for d in s), dt) for s, dt in zip(shapes, dts)]
        except symbols.SymbolError as err:
            raise ShapeError(f"op {self.name}: {err}") from None

    def cost(self, inputs: Sequence[TensorType], outputs: Sequence[TensorType], attrs: dict) -> Cost:
        moved = 0 if self.is_view else default_bytes(inputs, outputs, attrs)
        return Cost(int(self.flops(inputs, outputs, attrs)), moved)


def _canonical(value):
    """Sizes computed over symbols in their canonical form (`64`, not sympy's Integer)."""
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return symbols.dim(value) if isinstance(value, sympy.Expr) else value


_REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} registered twice")
    _REGISTRY[op.name] = op
    return op


def get(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}") from None


def has(name: str) -> bool:
    _ensure_loaded()
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


def _ensure_loaded() -> None:
    from . import ops  # noqa: F401  (registers every op on import)


class ShapeError(ValueError):
    """Inputs whose shapes or dtypes an op cannot take."""
