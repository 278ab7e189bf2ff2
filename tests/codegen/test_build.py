"""The kernel object cache (hit, miss, damaged or planted entry, killed build, two
processes building at once), vectorization, and the fallback
when no compiler works."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch

from opweave.codegen import FusionWarning, build, lower
from opweave.codegen.prelude import PRELUDE
from opweave.codegen.render import render
from opweave.ir import Graph, TensorType
from opweave.runtime import Executor

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    return build.cache_dir()


def _body(tag: str) -> str:
    return f'extern "C" int probe_{tag}(void) {{ return 42; }}\n'


def test_miss_builds_and_hit_reuses(cache, monkeypatch):
    monkeypatch.setattr(build, "_LOADED", {})
    lib = build.load(_body("a"))
    assert lib.probe_a() == 42
    assert len(list(cache.glob("*.so"))) == 1
    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("a cache hit must not compile"))
    monkeypatch.setattr(build, "_LOADED", {})   # as a new process would: from disk
    assert build.load(_body("a")).probe_a() == 42


def test_key_covers_compiler_flags_and_cpu(monkeypatch):
    k = build.key_of(_body("b"))
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DX",))
    assert build.key_of(_body("b")) != k


_LOAD_IN_NEW_PROCESS = """
import warnings
from opweave.codegen import build
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    lib = build.load({body!r})
print(lib.probe_c(), [str(w.message) for w in caught])
"""

# A valid object that is not the entry: if it is ever loaded, its constructor says so.
_PLANTED = """
#include <unistd.h>
__attribute__((constructor)) static void planted(void) { write(2, "PLANTED\\n", 8); }
extern "C" int probe_c(void) { return 7; }
"""


def _load_elsewhere(body: str) -> tuple[int, str, str]:
    """Load in a new process (a loaded object is never re-read in the process that loaded
    it), so that a crash inside the loader fails the test instead of killing pytest."""
    code = _LOAD_IN_NEW_PROCESS.format(body=body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


def _plant(entry, tmp_path, key: str) -> None:
    """Compile `_PLANTED` (claiming `key`, so only the content hash can refuse it) over
    `entry`."""
    src = tmp_path / "planted.cpp"
    src.write_text(build.full_source(_PLANTED, key))
    out = tmp_path / "planted.so"
    subprocess.run(["g++", *build.FLAGS, str(src), "-o", str(out)], check=True)
    entry.write_bytes(out.read_bytes())


def _damage(kind: str, entry, tmp_path) -> None:
    data = bytearray(entry.read_bytes())
    entry.unlink()  # a new inode, as a real corruption on disk would not share the old one's pages
    if kind == "not ELF":
        entry.write_bytes(b"not an ELF file")
    elif kind == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif kind == "flipped bytes":
        middle = len(data) // 2
        data[middle: middle + 200] = bytes(b ^ 0xFF for b in data[middle: middle + 200])
        entry.write_bytes(data)
    elif kind == "no hash":
        entry.write_bytes(data)
        build._sidecar(entry).unlink()
    else:
        _plant(entry, tmp_path, entry.stem)
        if kind == "planted, no hash":
            build._sidecar(entry).unlink()


@pytest.mark.parametrize("kind", ["not ELF", "truncated", "flipped bytes", "no hash",
                                  "planted", "planted, no hash"])
def test_damaged_entry_is_never_loaded_and_is_rebuilt(cache, tmp_path, kind):
    body = _body("c")
    assert _load_elsewhere(body)[:2] == (0, "42 []\n")
    (entry,) = cache.glob("*.so")
    _damage(kind, entry, tmp_path)
    rc, out, err = _load_elsewhere(body)
    assert rc == 0, f"loading a damaged entry crashed (exit {rc}): {err[-2000:]}"
    assert "PLANTED" not in err
    assert out.startswith("42 ") and out.count("opweave: cached kernel object") == 1
    assert f"{entry} " in out and "moved it to" in out and "rebuilding it" in out
    assert entry.read_bytes()[:4] == b"\x7fELF"
    assert build._problem(entry) is None
    assert _load_elsewhere(body)[:2] == (0, "42 []\n")
    assert sorted(p.name for p in cache.iterdir()) == sorted(  # nothing half-written
        [".lock", entry.name, entry.name + ".sha256", entry.name + ".corrupt"])


def test_planted_object_with_its_own_hash_is_refused_by_its_key(cache, tmp_path):
    """An object whose recorded hash matches but which names another key is rebuilt."""
    body = _body("c")
    _load_elsewhere(body)
    (entry,) = cache.glob("*.so")
    _plant(entry, tmp_path, "0" * 32)
    build._sidecar(entry).write_text(build._digest(entry) + "\n")
    rc, out, err = _load_elsewhere(body)
    assert rc == 0, err
    assert out.startswith("42 ") and "identifies itself with another key" in out
    assert _load_elsewhere(body)[:2] == (0, "42 []\n")


def test_generated_loops_vectorize(tmp_path):
    g = Graph("vec")
    x = g.add_input("x", TensorType((64, 512), torch.float32))
    g.outputs = [g.add1("gelu", [g.add1("add", [x, g.add_constant("b", torch.randn(512))])])]
    src = render(g, [n for n in g.nodes if n.op != "constant"], lambda v: v in g.outputs)
    path = tmp_path / "k.cpp"
    path.write_text(PRELUDE + src.body)
    proc = subprocess.run(["g++", *build.FLAGS, "-fopt-info-vec-optimized", str(path), "-o",
                           str(tmp_path / "k.so")], capture_output=True, text=True, check=True)
    assert "loop vectorized" in proc.stderr


def test_missing_compiler_falls_back_with_one_warning(cache, monkeypatch):
    monkeypatch.setattr(build, "COMPILER", "/nonexistent/g++")
    build.compiler_version.cache_clear()
    try:
        g = Graph("nocc")
        x = g.add_input("x", TensorType((4, 8), torch.float32))
        g.outputs = [g.add1("relu", [g.add1("neg", [x])])]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowered = lower(g, "ilp", measure=False)
        assert [w.category for w in caught] == [FusionWarning]
        assert "no working C++ compiler" in str(caught[0].message)
        assert lowered.kernel_counts() == {"reference": 1}
        x = torch.randn(4, 8)
        torch.testing.assert_close(Executor(g, steps=lowered.steps)(x)[0], torch.relu(-x))
    finally:
        build.compiler_version.cache_clear()


def test_fusion_off_runs_op_by_op():
    g = Graph("off")
    x = g.add_input("x", TensorType((4, 8), torch.float32))
    g.outputs = [g.add1("relu", [g.add1("neg", [x])])]
    from opweave.options import Options
    from opweave.pipeline import compile_graph

    ex = compile_graph(g, Options(fusion="off")).executor
    assert ex.lowered_steps is None
    with pytest.raises(ValueError, match="fusion must be one of"):
        Options(fusion="fast")


_BUILD_WITH = """
import sys
import time
from opweave.codegen import build
build.COMPILER = sys.argv[1]
print(build.load({body!r}).probe_k())
"""

_SLOW_COMPILER = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "slow-cc 1.0"; exit 0; fi
touch "{started}"
exec sleep 600
"""


def test_build_killed_midway_leaves_nothing_after_the_next_build(cache, tmp_path):
    """A process killed (SIGKILL: no cleanup runs) while its compiler runs leaves its
    build directory; the next build removes it, and nothing was ever put in $TMPDIR."""
    started, compiler = tmp_path / "started", tmp_path / "slow-cc"
    compiler.write_text(_SLOW_COMPILER.format(started=started))
    compiler.chmod(0o755)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    code = _BUILD_WITH.format(body=_body("k"))
    victim = subprocess.Popen([sys.executable, "-c", code, str(compiler)], env=env,
                              start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        for _ in range(2400):  # wait (up to minutes on a loaded machine) for the compiler
            if started.exists() or victim.poll() is not None:
                break
            time.sleep(0.05)
        assert started.exists(), victim.communicate()[1].decode()[-2000:]
    finally:
        os.killpg(victim.pid, signal.SIGKILL)  # the process and its compiler
        victim.wait()
    assert any(p.name.startswith(build.BUILD_PREFIX) for p in cache.iterdir())
    done = subprocess.run([sys.executable, "-c", code, "g++"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout == "42\n", done.stderr[-2000:]
    assert list(tmpdir.iterdir()) == []
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [".lock", *(p.name for p in cache.glob("*.so")), *(p.name for p in cache.glob("*.so.sha256"))])


def test_stale_build_directories_are_removed(cache):
    """Directories of processes that are gone, or older than the limit, are removed;
    those of live processes (this one) are kept."""
    cache.mkdir(parents=True)
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    gone = cache / f"{build.BUILD_PREFIX}{host}-{dead}-abc"
    live = cache / f"{build.BUILD_PREFIX}{host}-{os.getpid()}-abc"
    old = cache / f"{build.BUILD_PREFIX}other-host-{os.getpid()}-abc"
    recent = cache / f"{build.BUILD_PREFIX}other-host-1-abc"
    for d in (gone, live, old, recent):
        d.mkdir()
        (d / "kernels.cpp").write_text("")
    ancient = 2 * build.STALE_BUILD_SECONDS
    os.utime(old, (old.stat().st_atime - ancient, old.stat().st_mtime - ancient))
    build._remove_stale_builds(cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([live.name, recent.name])


_COMPILE_MLP = """
import torch, opweave
torch.manual_seed(0)
class Model(torch.nn.Module):  # no library anchors: which kernels exist depends on no timing
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
    def forward(self, x):
        h = torch.tanh(x * 3 + 1)
        return torch.softmax(self.norm(h) * 2, -1) + torch.nn.functional.gelu(x)
model = Model().eval()
x = torch.randn(4, 16)
compiled = opweave.compile(model, (x,), fusion="ilp")
with torch.no_grad():
    torch.testing.assert_close(compiled(x), model(x))
print("ok")
"""


def test_two_processes_build_the_same_model_into_an_empty_cache(cache):
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_MLP], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate() + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0 and out == "ok\n", err[-3000:]
    objects = sorted(cache.glob("*.so"))
    assert objects, "the model should have generated kernels"
    for entry in objects:
        assert build._problem(entry) is None
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [".lock", *(p.name for p in objects), *(p.name + ".sha256" for p in objects)])
