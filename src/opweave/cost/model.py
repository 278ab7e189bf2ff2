"""An analytic roofline cost model: time = max(FLOPs / peak, bytes / bandwidth) + launch.

It ranks alternatives (the rewrite extractor compares graphs with it); it is not a
predictor of absolute times. The defaults describe one core of the 2-core machines we
benchmark on (about 90 GFLOP/s fp32 GEMM peak per core, measured by `opweave bench`)
and the per-op dispatch cost of the Python executor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..ir import TensorType, registry


@dataclass(frozen=True)
class Machine:
    flops: float = 150e9      # FLOP/s reachable by a good GEMM on all cores
    bandwidth: float = 12e9   # bytes/s for streaming elementwise kernels
    launch: float = 4e-6      # seconds of dispatch per executed kernel
    view: float = 1e-6        # seconds per view op (reshape, permute, slice: no data moves)


CPU = Machine()
FREE_OPS = frozenset({"input", "constant", "get"})


def node_seconds(op: str, inputs: Sequence[TensorType], outputs: Sequence[TensorType],
                 attrs: dict, machine: Machine = CPU) -> float:
    """Estimated seconds one op takes; leaves (inputs, constants) are free."""
    if op in FREE_OPS:
        return 0.0
    opdef = registry.get(op)
    if opdef.is_view:
        return machine.view
    cost = opdef.cost(inputs, outputs, attrs)
    return max(cost.flops / machine.flops, cost.bytes / machine.bandwidth) + machine.launch
