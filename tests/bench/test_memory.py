"""The allocator's peak during a call: what the call allocates, not what came before."""
from __future__ import annotations

import torch

from opweave.bench.memory import peak_allocated_during

MIB = 2 ** 20


def test_peak_is_the_most_the_call_held_at_once():
    def call():
        a = torch.empty(4 * MIB, dtype=torch.uint8)
        b = torch.empty(8 * MIB, dtype=torch.uint8)
        del a
        c = torch.empty(2 * MIB, dtype=torch.uint8)
        return b, c

    assert peak_allocated_during(call) == 12 * MIB


def test_blocks_from_an_earlier_measurement_freed_now_do_not_lower_the_peak():
    kept = []
    peak_allocated_during(lambda: kept.append(torch.empty(16 * MIB, dtype=torch.uint8)))

    def call():
        kept.clear()  # frees the earlier call's block first
        return torch.empty(3 * MIB, dtype=torch.uint8)

    assert peak_allocated_during(call) == 3 * MIB
