"""Measure the peak bytes a call allocates on the CPU, from the profiler's memory events."""
from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak of (allocated - freed) bytes during `fn()`, counting from zero at its start.

    Memory held before the call (weights, a preallocated arena) is not counted; callers
    that hold memory between calls add it themselves.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak
