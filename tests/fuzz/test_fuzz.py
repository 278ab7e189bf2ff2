"""`opweave fuzz`: the generator, the comparison, the minimiser, the reproducer, and a
fixed-seed sample of the whole pipeline that must pass."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from opweave import cli
from opweave.fuzz import check, minimize, oracle, reproducer
from opweave.fuzz.generate import EXCLUDED, GenConfig, fuzzable_ops, generate
from opweave.ir import Graph, TensorType, parse_graph, print_graph, verify

F32 = torch.float32
SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_generated_graphs_verify_and_cover_the_registry():
    ops = Counter()
    for seed in range(60):
        g = generate(seed)
        verify(parse_graph(print_graph(g), g.constants))  # the text form round-trips
        assert 1 <= sum(n.op != "constant" for n in g.nodes) <= 8
        assert g.outputs
        ops.update(n.op for n in g.nodes)
    assert len(ops) >= 40, sorted(ops)
    assert not set(ops) & (set(EXCLUDED) - {"constant"})


def test_a_new_op_is_fuzzed_without_new_code():
    """Restricting the generator to one op (as a newly registered op would be drawn)
    builds graphs of that op from its rules alone."""
    for name in ("layer_norm", "matmul", "gather", "max_pool2d"):
        graphs = [generate(seed, GenConfig(ops=(name,), max_nodes=2)) for seed in range(3)]
        assert all(any(n.op == name for n in g.nodes) for g in graphs), name


def test_unknown_or_excluded_ops_are_refused_by_name():
    with pytest.raises(ValueError, match="dropout: random"):
        fuzzable_ops(("dropout",))


def test_draw_finds_inputs_eager_accepts():
    g = Graph("log_of_index")
    x = g.add_input("x", TensorType((4,), F32))
    i = g.add_input("i", TensorType((3,), torch.int64))
    g.outputs = [g.add1("log", [g.add1("index_select", [x, i], {"dim": 0})])]
    case = oracle.draw(g, seed=0)
    assert (case.inputs[1] >= 0).all() and (case.inputs[0][case.inputs[1]] > 0).all()


def test_inputs_on_which_an_integer_op_overflows_are_rejected():
    """Found by the fuzz run: 16 ** 16 wraps to 0 in torch's int64 and saturates in ONNX
    Runtime's; like a float overflow, such inputs test no compiler."""
    g = parse_graph("graph @g(%x: i64[4]) {\n  %p: i64[4] = pow(%x, %x)\n  return %p\n}\n", {})
    with pytest.raises(oracle.Rejected, match="pow overflows int64"):
        oracle.evaluate(g, [torch.tensor([1, 2, 16, 3])], check=True)
    oracle.evaluate(g, [torch.tensor([1, 2, 15, 3])], check=True)  # 15 ** 15 fits
    bits = parse_graph("graph @g(%x: i64[2]) {\n  %n: i64[2] = neg(%x)\n  return %n\n}\n", {})
    oracle.evaluate(bits, [torch.tensor([5, -7])], check=True)


def test_compare_allows_eager_noise_and_refuses_the_rest():
    e = torch.tensor([1.0, 2.0])
    assert check.compare([e + 5e-5], [e], [e.double()]) == ""
    assert "output 0" in check.compare([e + 1e-2], [e], [e.double()])
    # eager itself is 1e-2 from float64 here, so a backend may be too
    assert check.compare([e + 1e-2], [e], [e.double() + 1e-2]) == ""
    assert "got nan" in check.compare([torch.tensor([float("nan"), 2.0])], [e], [e.double()])
    ints = torch.tensor([1, 2])
    assert "at (1,)" in check.compare([torch.tensor([1, 3])], [ints], [ints])
    # a cast at a rounding boundary: eager and float64 disagree there, so may a backend
    assert check.compare([torch.tensor([1, 3])], [ints], [torch.tensor([1, 3])]) == ""
    assert "is torch.int32" in check.compare([ints.int()], [ints], [ints])


def _planted_case() -> oracle.Case:
    """Six ops; `exp` is the one a broken backend gets wrong."""
    g = Graph("planted")
    x = g.add_input("x", TensorType((2, 3), F32))
    y = g.add_input("y", TensorType((3,), F32))
    a = g.add1("tanh", [g.add1("mul", [x, y])])
    b = g.add1("exp", [a])
    c = g.add1("sin", [g.add1("add", [b, x])])
    g.outputs = [g.add1("sum", [c], {"dims": [1]}), g.add1("relu", [a])]
    return oracle.draw(g, seed=0)


def _broken_backend(case: oracle.Case) -> list[torch.Tensor]:
    """The eager oracle, except that exp is off by 1%."""
    g = case.graph
    env = dict(zip(g.inputs, case.inputs))
    for node in g.nodes:
        out = node.opdef.impl(*[env[v] for v in node.inputs], **node.attrs)
        env[node.outputs[0]] = out * 1.01 if node.op == "exp" else out
    return [env[v] for v in g.outputs]


def _fails(case: oracle.Case) -> bool:
    eager = oracle.run_eager(case.graph, case.inputs)
    shadow = oracle.run_shadow(case.graph, case.inputs)
    return check.compare(_broken_backend(case), eager, shadow) != ""


def test_minimizer_shrinks_a_planted_failure_to_its_node():
    case = _planted_case()
    assert _fails(case)
    small = minimize.minimize(case, _fails)
    assert [n.op for n in small.graph.nodes] == ["exp"]
    assert len(small.graph.inputs) == 1 and _fails(small)
    # the cut-off producer's values were kept: exp reads what tanh computed
    env = oracle.evaluate(case.graph, case.inputs)
    tanh = next(n for n in case.graph.nodes if n.op == "tanh").outputs[0]
    torch.testing.assert_close(small.inputs[0], env[tanh])


def test_tensor_literals_are_exact():
    for t in (torch.randn(2, 3), torch.randn(4, dtype=torch.float64),
              torch.tensor([1e-40, -0.0, 3.4e38]), torch.randint(-5, 5, (3, 1)),
              torch.rand(2, 2) < 0.5, torch.empty(0, 3), torch.tensor(2.5)):
        back = eval(reproducer.tensor_literal(t), {"torch": torch})
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)


def test_reproducer_runs_standalone(tmp_path):
    case = _planted_case()
    path = reproducer.write(tmp_path, "repro", case, path="onnx", seed=7, kind="mismatch",
                            message='output 0 differs "quoted" \\ backslash')
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left beside it
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "onnx: pass"


def test_fixed_seed_sample_passes(tmp_path, capsys):
    """The CI sample: a fixed seed through every path; ends with `N passed, 0 failed`."""
    out = tmp_path / "failures"
    code = cli.main(["fuzz", "--graphs", "12", "--seed", "2024", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-1]), "\n".join(lines)
    assert lines[-1].startswith("12 passed") and code == 0
    assert not out.exists()  # nothing failed, so nothing is left behind


def test_a_crash_while_drawing_leaves_how_to_draw_the_graph_again(tmp_path, monkeypatch):
    """Found by the 10,000-graph run: generating a graph runs its ops on trial shapes, and
    torch's fused attention died of SIGFPE there, before any graph could be written."""
    from opweave.fuzz import runner

    def die(seed, index, config):
        raise KeyboardInterrupt  # as far as the marker knows, the process died here
    monkeypatch.setattr(runner, "draw_case", die)
    out = tmp_path / "failures"
    runner.fuzz(runner.FuzzConfig(graphs=3, seed=7, out=str(out)), log=lambda line: None)
    text = (out / runner.DRAWING).read_text()
    assert "graph 0 of `opweave fuzz --seed 7" in text
    command = text.splitlines()[1].strip().removeprefix("python -X faulthandler -c ").strip("'")
    monkeypatch.undo()
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_float64_result_of_float32_work_is_held_to_float32_tolerance():
    """Found by the fuzz run: a float64 loss summed from float32 erf terms differed from
    eager by 7e-7 (generated and torch's erf round differently) and was called a mismatch."""
    from opweave.fuzz import check
    from opweave.ir import parse_graph

    expected = torch.tensor(1.9209069, dtype=torch.float64)
    shadow = expected - 7.52e-8  # eager's own distance from float64
    got = expected + 7.15e-7
    assert "loss 0" in check.compare([got], [expected], [shadow], "loss")
    assert check.compare([got], [expected], [shadow], "loss", torch.float32) == ""
    assert check.compare([got + 1e-3], [expected], [shadow], "loss", torch.float32)
    graph = parse_graph("""graph @g(%x: f32[2], %y: f64[2]) {
  %a: f64[2] = cast(%x) {dtype=f64}
  %b: f64[2] = add(%a, %y)
  return %b
}""", {})
    assert check.least_precise_float(graph) == torch.float32


def test_cli_refuses_unknown_paths(capsys):
    assert cli.main(["fuzz", "--graphs", "1", "--paths", "compile,nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_rules_check_catches_a_rule_that_disagrees_with_its_implementation(monkeypatch):
    from opweave.ir import registry

    monkeypatch.setattr(registry.get("exp"), "dtype_rule", lambda ins, attrs: [torch.float64])
    g = Graph("wrong_rule")
    x = g.add_input("x", TensorType((2, 3), F32))
    g.outputs = [g.add1("exp", [x])]
    outcome = check.check_path(check.RULES, oracle.draw(g, seed=0))
    assert outcome.failed and outcome.kind == "rules"
    assert "rules give (f64[2,3]), the implementation (f32[2,3])" in outcome.message
