"""Where opweave caches kernels and calibrations: empty or relative variables never put
the cache in the current directory (XDG base-directory spec)."""
from __future__ import annotations

from pathlib import Path

import pytest

from opweave.bench import roofline
from opweave.codegen import build
from opweave.files import cache_root


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
@pytest.mark.parametrize("explicit", [None, ""])
def test_empty_or_relative_variables_fall_back_to_home(monkeypatch, tmp_path, xdg, explicit):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    if explicit is None:
        monkeypatch.delenv("OPWEAVE_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("OPWEAVE_CACHE_DIR", explicit)
    home_cache = tmp_path / ".cache" / "opweave"
    assert cache_root() == home_cache
    assert build.cache_dir() == home_cache / f"kernels-v{build.CACHE_FORMAT}"
    assert roofline.cache_dir() == home_cache


def test_absolute_variables_are_used(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("OPWEAVE_CACHE_DIR", raising=False)
    assert build.cache_dir() == tmp_path / "xdg" / "opweave" / f"kernels-v{build.CACHE_FORMAT}"
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path / "mine"))
    assert build.cache_dir() == tmp_path / "mine" / f"kernels-v{build.CACHE_FORMAT}"
    assert roofline.cache_dir() == Path(tmp_path / "mine")
