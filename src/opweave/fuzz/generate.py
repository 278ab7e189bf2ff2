"""Random valid IR graphs, built from the op registry's own rules.

Nothing here knows an op's semantics. For each node the generator picks a registered op,
proposes operands (values already in the graph, or fresh inputs and constants whose types
are derived from the first operand: same shape, broadcastable, a contraction partner,
per-channel, an index...) and attributes (by kind, with a few hints keyed by attribute
name), and keeps the first proposal the op's shape and dtype rules accept. A new op is
fuzzed as soon as it is registered; `EXCLUDED` and `FIXED_ATTRS` list the exceptions.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from ..ir import Graph, MappingType, TensorType, Value, registry, verify
from ..ir.registry import REQUIRED

# Ops never generated, and why.
EXCLUDED = {
    "dropout": "random: no eager oracle gives the same mask",
    "constant": "not an op to draw: constants enter as fresh operands",
    "sparse_mm": "needs coalesced COO operands, which opweave takes only as constants",
    "scatter": "duplicate indices (which random indices have) leave the result unspecified",
    "max_pool2d_backward": "its indices must come from the forward pool (the training path "
                           "covers it)",
    "adaptive_max_pool2d_backward": "its indices must come from the forward pool (the "
                                    "training path covers it)",
}
# Attributes held fixed for an op, and why.
FIXED_ATTRS = {
    # without accumulate, duplicate indices leave which value wins unspecified
    "index_put": {"accumulate": True},
}
# Values for string attributes (strings cannot be guessed from a kind).
STR_CHOICES = {"approximate": ["none", "tanh"], "rounding": ["none", "floor", "trunc"]}

# The dtypes fresh operands and cast targets take. Half types are left out: their CPU
# kernels differ from eager by design (opweave may compute in f32), and ONNX export of
# bf16 constants is unsupported; i8/u8 out-of-range float casts are undefined behaviour.
DTYPES = (torch.float32,) * 4 + (torch.float64, torch.int64, torch.int64, torch.int32, torch.bool)
MAX_NUMEL = 256   # per value; keeps kernels and reductions small
MAX_DIM = 16
MAX_RANK = 5
ATTEMPTS = 150    # proposals per node before trying another op


@dataclass
class GenConfig:
    max_nodes: int = 8
    min_nodes: int = 2
    ops: tuple[str, ...] | None = None  # restrict to these ops (default: all but EXCLUDED)
    constant_rate: float = 0.2          # share of fresh operands that are constants


@dataclass
class Generated:
    graph: Graph
    op_counts: dict = field(default_factory=dict)


def fuzzable_ops(only=None) -> dict[str, registry.OpDef]:
    ops = {name: op for name, op in registry.all_ops().items()
           if name not in EXCLUDED and not op.is_random}
    if only:
        unknown = set(only) - set(ops)
        if unknown:
            raise ValueError(f"cannot fuzz op(s) {sorted(unknown)}: unknown or excluded "
                             f"({', '.join(f'{k}: {v}' for k, v in EXCLUDED.items() if k in unknown)})")
        ops = {k: v for k, v in ops.items() if k in only}
    return ops


def _weight(op: registry.OpDef) -> float:
    """Elementwise ops are many and cheap; the rest are drawn more often each, so GEMM,
    conv, reduction and layout chains show up."""
    return 1.0 if op.mapping is MappingType.ONE_TO_ONE else 2.5


class _Builder:
    def __init__(self, rng: random.Random, config: GenConfig):
        self.rng = rng
        self.config = config
        self.graph = Graph("fuzz")
        self.pool: list[Value] = []      # values operands may use
        self.uses: dict[int, int] = {}   # id(value) -> times used
        self.length = 2                  # the length of list attributes being proposed

    # -- fresh operand types ----------------------------------------------------------------
    def random_shape(self, rank: int | None = None) -> tuple[int, ...]:
        rng = self.rng
        rank = rng.choice((0, 1, 2, 2, 3, 3, 4)) if rank is None else rank
        shape = [rng.choice((1, 2, 3, 4, 5)) for _ in range(rank)]
        if shape and rng.random() < 0.03:
            shape[rng.randrange(rank)] = 0
        return tuple(shape)

    def random_dtype(self) -> torch.dtype:
        return self.rng.choice(DTYPES)

    def derived_type(self, ref: TensorType | None) -> TensorType:
        """A type likely to fit beside `ref` in some op: the families below cover
        broadcasting, contractions, per-channel operands, indices and matching ranks."""
        rng = self.rng
        if ref is None:
            return TensorType(self.random_shape(), self.random_dtype())
        shape = ref.shape
        dtype = ref.dtype if rng.random() < 0.7 else self.random_dtype()
        family = rng.randrange(9)
        if family == 0:
            new = shape
        elif family == 1:  # broadcastable: a suffix, some dims 1
            k = rng.randint(0, len(shape))
            new = tuple(1 if rng.random() < 0.3 else d for d in shape[len(shape) - k:])
        elif family == 2:
            new = ()
        elif family == 3 and len(shape) >= 2:  # contraction partner [..., K, N]
            new = shape[:-2] + (shape[-1], rng.choice((1, 2, 3, 4)))
            if rng.random() < 0.3:
                new = new[-2:]
        elif family == 4 and len(shape) >= 2:  # per channel
            new = (shape[1],)
        elif family == 5 and shape:  # trailing dims
            new = shape[len(shape) - rng.randint(1, len(shape)):]
        elif family == 6:  # same rank, dims from ref's and small ones
            pool = list(shape) + [1, 2, 3]
            new = tuple(rng.choice(pool) for _ in shape)
        elif family == 7:  # a short rank-1 index
            new, dtype = (rng.randint(1, 4),), rng.choice((torch.int64, torch.int64, torch.int32))
        else:
            new = self.random_shape()
        if family == 6 and rng.random() < 0.4:
            dtype = torch.int64
        return TensorType(tuple(new), dtype)

    # -- attributes -------------------------------------------------------------------------
    def propose_attr(self, name: str, spec: registry.Attr, ref: TensorType | None):
        rng = self.rng
        rank = ref.rank if ref is not None else rng.randint(0, 3)
        if spec.default is not REQUIRED and rng.random() < 0.3:
            return spec.default
        kind = spec.kind
        if kind == "int" or kind == "optional_int":
            if kind == "optional_int" and rng.random() < 0.3:
                return None
            if rank and rng.random() < 0.7:
                return rng.randrange(-rank, rank)
            return rng.randint(1, 4)
        if kind == "ints":
            return self.propose_ints(name, ref)
        if kind == "bool":
            return rng.random() < 0.5
        if kind in ("float", "optional_float"):
            if kind == "optional_float" and rng.random() < 0.35:
                return None
            return rng.choice((0.5, -0.5, 1.0, -1.0, 2.0, 0.1, 1e-5, 0.25, -1.5))
        if kind == "scalar":
            return rng.choice((0, 1, 2, -1, 0.5, -1.5, 3.0, True, False))
        if kind == "str":
            return rng.choice(STR_CHOICES.get(name, [spec.default]))
        if kind == "dtype":
            return self.random_dtype()
        raise AssertionError(f"no proposal for attribute kind {kind!r}")

    def propose_ints(self, name: str, ref: TensorType | None) -> list[int]:
        rng = self.rng
        shape = ref.shape if ref is not None else self.random_shape()
        rank = len(shape)
        if name == "dims":
            if rng.random() < 0.5:  # a permutation
                dims = list(range(rank))
                rng.shuffle(dims)
            else:  # a subset
                dims = [d for d in range(rank) if rng.random() < 0.5] or list(range(rank))[:1]
            return [d - rank if rng.random() < 0.3 else d for d in dims]
        if name in ("shape", "normalized_shape", "output_size"):
            choice = rng.randrange(4)
            if choice == 0 and shape:  # reshape: regroup the dims
                return _regroup(list(shape), rng)
            if choice == 1:  # expand: grow size-1 dims, maybe add leading ones
                grown = [rng.choice((d, 2, 3)) if d == 1 else d for d in shape]
                return [rng.choice((2, 3))] * rng.randint(0, 1) + grown
            if choice == 2 and shape:  # a suffix of the shape
                return list(shape[rank - rng.randint(1, rank):])
            return list(self.random_shape())
        # kernels, strides, paddings, dilations, masks: short lists of small ints, as
        # long as the spatial dims, the whole rank, or a fixed small count
        length = self.length if rng.random() < 0.8 else rng.choice((rank, 1, 2, 3))
        return [rng.choice((0, 1, 1, 1, 2, 3)) for _ in range(length)]

    # -- nodes ------------------------------------------------------------------------------
    def pick_existing(self) -> Value | None:
        if not self.pool:
            return None
        # recent, little-used values first: chains and branching DAGs both appear
        weights = [(i + 1) / (1 + self.uses.get(id(v), 0)) for i, v in enumerate(self.pool)]
        return self.rng.choices(self.pool, weights)[0]

    def try_node(self, name: str, opdef: registry.OpDef) -> bool:
        rng = self.rng
        for _ in range(ATTEMPTS):
            count = opdef.num_inputs if opdef.num_inputs is not None else rng.randint(1, 3)
            operands: list[Value | TensorType] = []
            for i in range(count):
                # derive from the first operand, or from the one before (weight, bias)
                ref = (operands[0] if rng.random() < 0.5 else operands[-1]) if operands else None
                ref_type = ref.type if isinstance(ref, Value) else ref
                r = rng.random()
                if i == 0:
                    existing = self.pick_existing() if r < 0.85 else None
                    operands.append(existing or self.derived_type(None))
                elif r < 0.3 and self.pool:
                    operands.append(rng.choice(self.pool))
                elif r < 0.4 and isinstance(ref, Value):
                    operands.append(ref)  # x op x
                elif r < 0.7 and i >= 2:
                    prev = operands[-1]  # operands often share a type (weight, bias, stats)
                    operands.append(prev.type if isinstance(prev, Value) else prev)
                else:
                    operands.append(self.derived_type(ref_type))
            types = [o.type if isinstance(o, Value) else o for o in operands]
            ref_type = types[0] if types else None
            # list attributes of one node (stride, padding, dilation) share a length
            self.length = rng.choice([max((ref_type.rank if ref_type else 2) - 2, 1)] * 4
                                     + [1, 2, 3])
            attrs = {k: self.propose_attr(k, spec, ref_type) for k, spec in opdef.attrs.items()}
            attrs.update(FIXED_ATTRS.get(name, {}))
            try:
                outs = opdef.infer(types, opdef.full_attrs(attrs))
            except Exception:  # noqa: BLE001  (any rejection by the rules: try again)
                continue
            if not outs or not all(_small(t) for t in outs + types):
                continue
            if any(t.dtype not in DTYPES for t in outs) or not _runs(opdef, types, attrs):
                continue
            values = [o if isinstance(o, Value) else self.fresh(o) for o in operands]
            for v in values:
                self.uses[id(v)] = self.uses.get(id(v), 0) + 1
            self.pool.extend(self.graph.add(name, values, attrs))
            return True
        return False

    def fresh(self, t: TensorType) -> Value:
        """A new graph input or, sometimes, a constant (its data is drawn with the inputs)."""
        if self.rng.random() < self.config.constant_rate:
            return self.graph.add_constant("w", torch.zeros(t.shape, dtype=t.dtype))
        return self.graph.add_input("x", t)


def _runs(opdef: registry.OpDef, types, attrs) -> bool:
    """Whether the reference implementation takes operands of these types at all (rules
    can be looser than torch: a dtype a kernel lacks, a rank only the kernel checks).
    Tried on zeros, then ones (zeros are in-range indices, ones are safe divisors)."""
    full = opdef.full_attrs(attrs)
    for fill in (0, 1):
        try:
            opdef.impl(*[torch.full(t.shape, fill, dtype=t.dtype) for t in types], **full)
            return True
        except Exception:  # noqa: BLE001
            continue
    return False


def _small(t: TensorType) -> bool:
    return t.numel <= MAX_NUMEL and t.rank <= MAX_RANK and all(d <= MAX_DIM for d in t.shape)


def _regroup(shape: list[int], rng: random.Random) -> list[int]:
    """A new shape of the same size: merge neighbours, split, drop or add 1s."""
    out = list(shape)
    for _ in range(rng.randint(1, 3)):
        move = rng.randrange(4)
        if move == 0 and len(out) >= 2:
            i = rng.randrange(len(out) - 1)
            out[i:i + 2] = [out[i] * out[i + 1]]
        elif move == 1 and out:
            i = rng.randrange(len(out))
            factors = [f for f in (2, 3) if out[i] % f == 0 and out[i] > f]
            if factors:
                f = rng.choice(factors)
                out[i:i + 1] = [f, out[i] // f]
        elif move == 2 and 1 in out:
            out.remove(1)
        elif len(out) < MAX_RANK:
            out.insert(rng.randint(0, len(out)), 1)
    if math.prod(out) != math.prod(shape):
        return list(shape)
    return out


def generate(seed: int, config: GenConfig | None = None) -> Graph:
    """A verified random graph; its constants hold placeholder zeros (see `data.draw`)."""
    config = config or GenConfig()
    rng = random.Random(seed)
    ops = fuzzable_ops(config.ops)
    names = sorted(ops)
    weights = [_weight(ops[n]) for n in names]
    builder = _Builder(rng, config)
    for _ in range(rng.randint(1, 2)):
        builder.pool.append(builder.graph.add_input("x", builder.derived_type(None)))
    target = rng.randint(config.min_nodes, max(config.min_nodes, config.max_nodes))
    tries = 0
    while sum(1 for n in builder.graph.nodes if n.op != "constant") < target and tries < 20 * target:
        tries += 1
        name = rng.choices(names, weights)[0]
        builder.try_node(name, ops[name])
    return _finish(builder)


def _finish(builder: _Builder) -> Graph:
    graph = builder.graph
    produced = [v for n in graph.nodes if n.op != "constant" for v in n.outputs]
    used = {id(v) for n in graph.nodes for v in n.inputs}
    outputs = [v for v in produced if id(v) not in used]
    # sometimes an intermediate value is an output too (a value with users outside)
    outputs += [v for v in produced if id(v) in used and builder.rng.random() < 0.15]
    if not outputs and produced:
        outputs = produced[-1:]
    graph.outputs = outputs
    graph.remove_dead()
    live = {id(v) for n in graph.nodes for v in n.inputs} | {id(v) for v in graph.outputs}
    graph.inputs = [v for v in graph.inputs if id(v) in live]
    return verify(graph)
