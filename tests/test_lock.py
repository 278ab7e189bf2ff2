"""requirements.lock pins what pyproject.toml asks for, and this environment was
installed from it (the Makefile's targets install with `-c requirements.lock`)."""
from __future__ import annotations

import re
import tomllib
import site
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def locked() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if match:
            pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        texts += extra
    return [r for r in map(Requirement, texts) if canonicalize_name(r.name) != "opweave"]


def test_every_declared_dependency_is_pinned_within_its_range():
    pins = locked()
    problems = []
    for req in declared():
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            problems.append(f"{req.name} is not in requirements.lock")
        elif not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req.name}: locked {pin} is outside pyproject's {req.specifier}")
    assert not problems, "run `make lock`: " + "; ".join(problems)


def test_torch_is_the_pinned_cpu_release():
    assert str(locked()["torch"]).startswith("2.13.0")


def test_this_environment_matches_the_lock():
    """Every locked package that is installed has the locked version. Only the
    environment's own site-packages count: packages vendor others (setuptools puts its
    `_vendor` directory, with an older platformdirs, on sys.path once imported)."""
    pins = locked()
    wrong = []
    for dist in metadata.distributions(path=site.getsitepackages()):
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name in pins and Version(dist.version) != pins[name]:
            wrong.append(f"{name} {dist.version} (locked {pins[name]})")
    assert not wrong, "reinstall with `make install`: " + ", ".join(sorted(wrong))


def test_the_lock_names_no_local_path():
    """A `pkg @ file:///...` pin holds the path of the checkout that made the lock: a clone
    anywhere else could not install with it."""
    text = (ROOT / "requirements.lock").read_text()
    assert not [line for line in text.splitlines() if " @ " in line and not line.startswith("#")]
