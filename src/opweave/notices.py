"""Telling the user something once per process: a fallback or a skipped pass is news the
first time, noise the hundredth."""
from __future__ import annotations

import threading
import warnings

_WARNED: set[str] = set()
_LOCK = threading.Lock()  # two threads giving the same news at once: one says it


class OpweaveFallbackWarning(UserWarning):
    """Part of a model runs without some of opweave's work (in eager PyTorch, or with a
    pass skipped) because opweave cannot handle it yet; the results are still right."""


class OpweavePerformanceWarning(UserWarning):
    """Something outside the compiled model makes its calls measurably slower, and the
    user can change it (the message says how); the results are right."""


def warn_once(message: str, category: type[Warning], stacklevel: int = 3) -> None:
    """`warnings.warn(message, category)` unless this message was already given."""
    with _LOCK:
        if message in _WARNED:
            return
        _WARNED.add(message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
