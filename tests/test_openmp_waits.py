"""`import opweave` before torch loads libgomp with OMP_WAIT_POLICY=active and
GOMP_SPINCOUNT=300000 (openmp_waits.py), leaves no trace in the environment, and leaves
libgomp alone where torch came first, the user chose, or OPWEAVE_OPENMP_WAITS=system.
libgomp's own account of what it read (OMP_DISPLAY_ENV) is the evidence. Where torch came
first, a compiled call from a second thread says once what to set."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from opweave import notices, openmp_waits
from opweave.pipeline import compile_graph

from .runtime.test_native import OPTIONS, _fused_graph, _warm

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not openmp_waits._torch_bundles_libgomp(),
    reason="torch's wheel with its own libgomp, on Linux")

REPORT = ("import json, os, sys; waits = sys.modules['opweave'].openmp_waits; "
          "assert not any(isinstance(f, waits._RestoreAfterTorch) for f in sys.meta_path); "
          "print(json.dumps({'applied': waits.applied(), 'environment': "
          "{k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}}))")


def _run(imports: str, **environment) -> tuple[dict, dict]:
    """(the child's report, what libgomp says it read) after `imports`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.ENV)}
    env.update(environment, OMP_DISPLAY_ENV="verbose")
    done = subprocess.run([sys.executable, "-c", f"{imports}; torch.ones(1); {REPORT}"],
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
    report, read = _run("import os, opweave; os.environ['OMP_NUM_THREADS'] = '1'; import torch")
    assert read == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "300000",
                    "OMP_NUM_THREADS": "1"}
    assert report["applied"]
    report, read = _run("import os, opweave; os.environ['OMP_NUM_THREADS'] = '1'; "
                        "os.environ['GOMP_SPINCOUNT'] = '5000'; import torch")
    # the program chose a spin count: libgomp reads its choice alone, as where it was
    # set before opweave's import
    assert read == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5000",
                    "OMP_NUM_THREADS": "1"}
    assert report == {"applied": False,  # not both as set: explain does not claim it
                      "environment": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5000"}}


def test_a_spec_asked_for_first_does_not_keep_the_environment_set():
    """transformers, for one, asks importlib whether torch is there before importing it."""
    report, read = _run("import importlib.util, opweave; importlib.util.find_spec('torch'); "
                        "importlib.util.find_spec('torch'); import torch")
    assert report == {"applied": True,
                      "environment": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}}
    assert read["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_failed_torch_import_puts_the_environment_back(tmp_path):
    fake = tmp_path / "torch"
    (fake / "lib").mkdir(parents=True)
    (fake / "lib" / "libgomp.so.1").touch()
    (fake / "__init__.py").write_text("raise ImportError('a broken torch')\n")
    code = (f"import json, os, sys; sys.path.insert(0, {str(tmp_path)!r}); import opweave\n"
            "try:\n    import torch\nexcept ImportError as e:\n    said = str(e)\n"
            "print(json.dumps([said, opweave.openmp_waits.applied(), "
            "[os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')]]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.ENV)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["a broken torch", False, [None, None]]


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


def test_an_unknown_mode_is_refused_by_name_and_leaves_libgomp_alone():
    with pytest.raises(ValueError, match="OPWEAVE_OPENMP_WAITS must be one of spin, system"):
        openmp_waits.check_mode("always")
    done = subprocess.run([sys.executable, "-c", "import opweave"], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, openmp_waits.ENV: "always"})
    assert done.returncode == 0, done.stderr
    assert "OPWEAVE_OPENMP_WAITS must be one of spin, system; got 'always': libgomp is " \
        "left as it is" in done.stderr
    report, read = _run("import opweave, torch", OPWEAVE_OPENMP_WAITS=" System ")
    assert not report["applied"] and read["OMP_WAIT_POLICY"] == "PASSIVE"


EXPLAINED = ("m = torch.nn.Linear(4, 4).eval(); x = torch.randn(2, 4); "
             "g = opweave.compile(m, [x], options=opweave.Options(native='wait')); "
             "[g(x) for _ in range(4)]; "
             "said = \"second calling thread's OpenMP waits spin\" in "
             "g.program.compiled_graphs[0].executor.native.describe(); "
             "print('said' if said else 'not'); ")


def test_explain_says_so_where_it_was_set():
    for imports, applied in (("import opweave, torch", True), ("import torch, opweave", False)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.ENV)}
        done = subprocess.run([sys.executable, "-c", f"{imports}; {EXPLAINED}"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == ("said" if applied else "not")


def _second_thread_warnings(monkeypatch, threads: int, **environment) -> list[str]:
    """The performance warnings a plan's calls give, from the main thread and then from a
    second one, with torch on `threads` threads and libgomp as torch loaded it."""
    monkeypatch.setattr(openmp_waits, "watching", True)
    monkeypatch.setattr(notices, "_WARNED", set())
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", openmp_waits.ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    executor = compile_graph(_fused_graph(), OPTIONS).executor
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _warm(executor, lambda: [torch.randn(8, 16)], calls=4)
            assert executor.native.plan is not None and openmp_waits.watching
            for _ in range(2):
                caller = threading.Thread(target=executor, args=(torch.randn(8, 16),))
                caller.start()
                caller.join()
    finally:
        torch.set_num_threads(before)
    assert not openmp_waits.watching  # checked once, whatever it found
    return [str(w.message) for w in seen
            if issubclass(w.category, notices.OpweavePerformanceWarning)]


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two CPUs or more")


@two_cpus
def test_a_second_threads_call_says_once_what_to_set(monkeypatch):
    (said,) = _second_thread_warnings(monkeypatch, len(os.sched_getaffinity(0)))
    assert "OMP_WAIT_POLICY=active GOMP_SPINCOUNT=300000" in said
    assert "import opweave before torch" in said and "OPWEAVE_OPENMP_WAITS=system" in said


@two_cpus
def test_nothing_is_said_where_two_teams_fit_or_the_user_chose(monkeypatch):
    assert _second_thread_warnings(monkeypatch, 1) == []
    monkeypatch.setattr(openmp_waits, "_applied", True)  # loaded with the settings
    assert _second_thread_warnings(monkeypatch, len(os.sched_getaffinity(0))) == []
    monkeypatch.setattr(openmp_waits, "_applied", False)
    cpus = len(os.sched_getaffinity(0))
    assert _second_thread_warnings(monkeypatch, cpus, OPWEAVE_OPENMP_WAITS="system") == []
    assert _second_thread_warnings(monkeypatch, cpus, GOMP_SPINCOUNT="10000") == []
