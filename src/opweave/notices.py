"""Telling the user something once per process: a fallback or a skipped pass is news the
first time, noise the hundredth."""
from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_once(message: str, category: type[Warning], stacklevel: int = 3) -> None:
    """`warnings.warn(message, category)` unless this message was already given."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
