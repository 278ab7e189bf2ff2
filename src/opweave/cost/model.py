"""An analytic roofline cost model: time = max(FLOPs / peak, bytes / bandwidth) + launch,
where the bandwidth is the cache's when the op's data fits in cache and DRAM's otherwise.

It ranks alternatives (the rewrite extractor compares graphs with it, the partitioner
scores fused groups); it is not a predictor of absolute times. Its parameters are the
machine's measured ones when the tuning database holds them (`opweave tune machine`,
activated per compile with `using`); else the defaults below, which describe the 2-core
machines we benchmark on (about 150 GFLOP/s fp32 GEMM on both cores) and are what every
compile uses without a measurement, so plans never depend on a timing taken mid-compile.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..ir import TensorType, registry, symbols


@dataclass(frozen=True)
class Machine:
    flops: float = 150e9      # FLOP/s reachable by a good GEMM on all cores
    bandwidth: float = 12e9   # bytes/s for streaming elementwise kernels out of DRAM
    launch: float = 4e-6      # seconds of dispatch per executed kernel
    view: float = 1e-6        # seconds per view op (reshape, permute, slice: no data moves)
    cache_bytes: int = 0      # an op moving at most this many bytes runs from cache...
    cache_bandwidth: float = 0.0  # ...at this rate (0: no cache level is modelled)

    def check(self) -> None:
        """ValueError unless every parameter is finite and positive (the cache ones may
        be 0: not modelled)."""
        for name in ("flops", "bandwidth", "launch", "view"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"machine parameter {name} is {value!r}, not a finite positive number")
        for name in ("cache_bytes", "cache_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"machine parameter {name} is {value!r}, not a finite number >= 0")

    def seconds(self, flops: float, nbytes: float) -> float:
        """The roofline time of `flops` over `nbytes` of traffic, plus one launch."""
        fits = self.cache_bandwidth > 0 and nbytes <= self.cache_bytes
        return max(flops / self.flops, nbytes / (self.cache_bandwidth if fits else self.bandwidth)) \
            + self.launch


CPU = Machine()
FREE_OPS = frozenset({"input", "constant", "get"})
_ACTIVE: ContextVar[Machine] = ContextVar("opweave_machine", default=CPU)
_SIZES: ContextVar[Mapping[str, int] | None] = ContextVar("opweave_sizes", default=None)


def active() -> Machine:
    """The machine costs are estimated for in this compile."""
    return _ACTIVE.get()


@contextmanager
def using(machine: Machine):
    token = _ACTIVE.set(machine)
    try:
        yield machine
    finally:
        _ACTIVE.reset(token)


@contextmanager
def at_sizes(binding: Mapping[str, int]):
    """Cost ops of symbolic sizes at `binding`: a graph compiled once for many sizes is
    rewritten for the sizes it was first called with, as torch uses its example sizes as
    hints. Without it, a symbolic size has no estimate (SymbolError)."""
    token = _SIZES.set(dict(binding))
    try:
        yield
    finally:
        _SIZES.reset(token)


def node_seconds(op: str, inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                 attrs: dict, machine: Machine | None = None) -> float:
    """Estimated seconds one op takes; leaves (inputs, constants) are free."""
    if op in FREE_OPS:
        return 0.0
    if not all(t.is_static for t in (*inputs, *outputs)):
        sizes = _SIZES.get()
        if sizes is None:
            raise symbols.SymbolError(f"{op} has symbolic sizes and no sizes to cost it at "
                                      f"(cost.at_sizes)")
        inputs = [t.substitute(sizes) for t in inputs]
        outputs = [t.substitute(sizes) for t in outputs]
        attrs = {k: symbols.substitute(a, sizes) for k, a in attrs.items()}
    machine = machine or active()
    opdef = registry.get(op)
    if opdef.is_view:
        return machine.view
    cost = opdef.cost(inputs, outputs, attrs)
    return machine.seconds(cost.flops, cost.bytes)
