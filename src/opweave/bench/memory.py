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
