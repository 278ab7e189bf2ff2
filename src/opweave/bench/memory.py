"""Peak resident memory of this process during a call, for any runtime (torch or not)."""
from __future__ import annotations

from typing import Callable


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def peak_rss_during(fn: Callable[[], object]) -> int | None:
    """Peak resident set size (bytes) of this process while `fn()` runs.

    Resets the kernel's high-water mark first (`/proc/self/clear_refs`, Linux), so the
    figure is the peak of this call, weights and runtime caches included. None where the
    platform cannot reset it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        fn()
        return None
    fn()
    return _status_kib("VmHWM") * 1024


def peak_allocated_during(fn: Callable[[], object]) -> int:
    """Peak bytes of the tensors `fn()` allocates, as PyTorch's CPU allocator reports them
    to the profiler: the running sum of its allocations, less those it frees again. A
    block allocated before (freed during the call) does not count: the allocator's own
    running total carries blocks from earlier profiled calls, which would skew it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            fields = node.typed[1]
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    live = peak = 0
    mine: dict[int, int] = {}
    for _, ptr, size in sorted(events):
        if size > 0:
            mine[ptr] = size
            live += size
            peak = max(peak, live)
        else:
            live -= mine.pop(ptr, 0)
    return peak
