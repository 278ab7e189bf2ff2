"""Writing files atomically: readers see the old file or the new one, never half of one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """opweave's cache: `$OPWEAVE_CACHE_DIR`, else `$XDG_CACHE_HOME/opweave`, else
    `~/.cache/opweave`. An empty variable counts as unset, and a relative
    `$XDG_CACHE_HOME` is ignored, as the XDG spec asks: else the cache would land in
    whatever directory the process happens to run in."""
    explicit = os.environ.get("OPWEAVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "opweave"


def atomic_write(path: "str | os.PathLike", write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary path beside `path` (same suffix, so tools that
    infer the format from it work), then rename it over `path`. On any failure the
    temporary file is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_bytes(path: "str | os.PathLike", data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))
