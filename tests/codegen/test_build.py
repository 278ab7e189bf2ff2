"""The kernel object cache (hit, miss, corrupted entry), vectorization, and the fallback
when no compiler works."""
from __future__ import annotations

import shutil
import subprocess
import sys
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
    return tmp_path / "kernels"


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


def test_corrupted_entry_is_rebuilt(cache):
    """A later process finds a damaged object (a loaded object is never re-read in the
    process that loaded it, so the check is exercised where it matters: a new process)."""
    def load_elsewhere():
        code = _LOAD_IN_NEW_PROCESS.format(body=_body("c"))
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout
    assert load_elsewhere().startswith("42 []")
    (entry,) = cache.glob("*.so")
    entry.unlink()
    entry.write_bytes(b"not an ELF file")
    out = load_elsewhere()
    assert out.startswith("42 ") and "failed its check; rebuilding it" in out
    assert entry.read_bytes()[:4] == b"\x7fELF"
    assert load_elsewhere().startswith("42 []")
    assert sorted(p.name for p in cache.iterdir()) == [entry.name]  # nothing half-written


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
