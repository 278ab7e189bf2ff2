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
    """Peak bytes PyTorch's CPU allocator held during `fn()` above what it held before
    (the profiler's allocation events): the tensors a call makes, nothing else."""
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
            events.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
    if not events:
        return 0
    events.sort()
    before = events[0][1] - events[0][2]
    return max(total for _, total, _ in events) - before
