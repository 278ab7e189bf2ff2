"""`import opweave` before torch loads libgomp with OMP_WAIT_POLICY=active and
GOMP_SPINCOUNT=300000 (openmp_waits.py), leaves no trace in the environment, and leaves
libgomp alone where torch came first, the user chose, or OPWEAVE_OPENMP_WAITS=system.
libgomp's own account of what it read (OMP_DISPLAY_ENV) is the evidence."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opweave import openmp_waits

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not openmp_waits._torch_bundles_libgomp(),
    reason="torch's wheel with its own libgomp, on Linux")

REPORT = ("import json, os, sys; print(json.dumps({'applied': "
          "sys.modules['opweave'].openmp_waits.applied(), 'environment': "
          "{k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}}))")


def _run(imports: str, then: str = "", **environment) -> tuple[dict, dict]:
    """(the child's report, what libgomp says it read) after `imports` and `then`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.ENV)}
    env.update(environment, OMP_DISPLAY_ENV="verbose")
    done = subprocess.run([sys.executable, "-c", f"{imports}; torch.ones(1); {then}{REPORT}"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    read = {}
    for line in done.stderr.splitlines():  # "  OMP_WAIT_POLICY = 'ACTIVE'"
        name, _, value = line.strip().partition(" = ")
        if name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
            read[name] = value.strip("'")
    return json.loads(done.stdout.splitlines()[-1]), read


def test_opweave_first_sets_libgomp_and_restores_the_environment():
    report, read = _run("import opweave, torch")
    assert report == {"applied": True,
                      "environment": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}}
    assert read["OMP_WAIT_POLICY"] == "ACTIVE" and read["GOMP_SPINCOUNT"] == "300000"


def test_what_the_program_sets_between_the_imports_counts():
    """As the bench's workers do: opweave imported, thread settings made, torch imported."""
    report, read = _run("import os, opweave; os.environ['OMP_NUM_THREADS'] = '1'; "
                        "os.environ['GOMP_SPINCOUNT'] = '5000'; import torch")
    assert read == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5000",
                    "OMP_NUM_THREADS": "1"}
    assert report == {"applied": False,  # not both as set: explain does not claim it
                      "environment": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5000"}}


def test_torch_first_is_left_alone():
    report, read = _run("import torch, opweave")
    assert not report["applied"]
    assert read["OMP_WAIT_POLICY"] == "PASSIVE"  # libgomp's word for "not set"


def test_system_mode_and_the_users_choice_are_left_alone():
    report, read = _run("import opweave, torch", OPWEAVE_OPENMP_WAITS="system")
    assert not report["applied"] and read["OMP_WAIT_POLICY"] == "PASSIVE"
    report, read = _run("import opweave, torch", GOMP_SPINCOUNT="1000")
    assert not report["applied"]
    assert read["OMP_WAIT_POLICY"] == "PASSIVE" and read["GOMP_SPINCOUNT"] == "1000"
    assert report["environment"]["GOMP_SPINCOUNT"] == "1000"


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="OPWEAVE_OPENMP_WAITS must be one of spin, system"):
        openmp_waits.check_mode("always")


EXPLAINED = ("g = opweave.compile(torch.nn.Linear(4, 4).eval(), [torch.randn(2, 4)]); "
             "assert 'OpenMP waits of a second calling thread spin' in "
             "g.program.compiled_graphs[0].report('lower'); ")


def test_explain_says_so_where_it_was_set():
    assert _run("import opweave, torch", then=EXPLAINED)[0]["applied"]
    with pytest.raises(AssertionError, match="AssertionError"):
        _run("import torch, opweave", then=EXPLAINED)
