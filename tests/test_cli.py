"""The `opweave` command."""
from __future__ import annotations

import subprocess
import sys

import pytest

from opweave.cli import main


def test_explain_prints_coverage_and_ir(capsys):
    assert main(["explain", "xmlcnn", "--small", "--ir"]) == 0
    out = capsys.readouterr().out
    assert "model xmlcnn: captured with export" in out
    assert "run by opweave: 27 (100.0%), in eager: 0" in out
    assert "adaptive_max_pool2d" in out and "fallbacks: none" in out
    assert "graph breaks under torch.compile: 0" in out
    assert "graph @xmlcnn_0(" in out  # the IR itself


def test_demo_on_small_models_reports_every_model(capsys):
    assert main(["demo", "--small", "--runs", "2", "gcn", "resnet50"]) == 0
    out = capsys.readouterr().out
    assert "gcn " in out and "resnet50 " in out
    assert "All outputs within" in out


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "opweave.cli", "explain", "nope"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice: 'nope'" in result.stderr


def test_bench_zoo_selects_the_zoo_after_named_models():
    import argparse

    from opweave import models
    from opweave.cli import bench_models

    assert bench_models(argparse.Namespace(models=None, zoo=False)) == list(models.BENCHMARK_SET)
    assert bench_models(argparse.Namespace(models=None, zoo=True)) == list(models.ZOO_SET)
    chosen = bench_models(argparse.Namespace(models=["gcn", "zoo-gpt2"], zoo=True))
    assert chosen[:2] == ["gcn", "zoo-gpt2"] and chosen.count("zoo-gpt2") == 1
    assert set(chosen) == {"gcn", *models.ZOO_SET}


def test_bf16_is_refused_for_training_steps_with_the_reason(capsys):
    assert main(["explain", "gcn", "--small", "--train", "--precision", "bf16"]) == 2
    assert "training steps compute in float32" in capsys.readouterr().err
    assert main(["bench", "--mode", "train", "--precision", "bf16", "--no-progress"]) == 2
    assert "training steps compute in float32" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_calls_per_run_below_one_is_refused_on_every_device(capsys, device):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--calls", "0", "--device", device, "--no-progress"])
    assert exit_.value.code == 2
    assert "--calls: must be at least 1, got 0" in capsys.readouterr().err


def _bench_config(monkeypatch, argv):
    """The BenchConfig `opweave bench` builds from `argv` (nothing runs)."""
    from opweave.bench import harness

    seen = []

    def fake_run(config, progress=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(harness, "run", fake_run)
    with pytest.raises(SystemExit):
        main(["bench", "--models", "gcn", *argv, "--no-progress"])
    return seen[-1]


def test_calls_per_run_default_one_on_the_cpu(monkeypatch):
    assert _bench_config(monkeypatch, []).calls == 1
    assert _bench_config(monkeypatch, ["--calls", "5"]).calls == 5


def test_a_pause_before_each_call_reaches_the_bench_and_is_checked(monkeypatch, capsys):
    assert _bench_config(monkeypatch, []).pause_ms == 0.0
    assert _bench_config(monkeypatch, ["--pause", "100"]).pause_ms == 100.0
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--pause", bad, "--no-progress"])
        assert exit_.value.code == 2 and "--pause" in capsys.readouterr().err
    for other in (["--device", "cuda"], ["--overhead"], ["--dynamic"]):
        assert main(["bench", "--pause", "30", *other, "--no-progress"]) == 2
        assert "--pause applies to the CPU bench of latencies" in capsys.readouterr().err


def test_the_caller_reaches_the_bench_and_is_checked(monkeypatch, capsys):
    assert _bench_config(monkeypatch, []).caller == "main"
    assert _bench_config(monkeypatch, ["--caller", "thread"]).caller == "thread"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--caller", "server", "--no-progress"])
    assert exit_.value.code == 2 and "--caller" in capsys.readouterr().err
    assert main(["bench", "--caller", "thread", "--overhead", "--no-progress"]) == 2
    assert "--caller applies to the CPU bench of latencies" in capsys.readouterr().err


def test_the_cli_knows_every_precision_the_compiler_does():
    from opweave.cli import COMPILE_PRECISIONS
    from opweave.options import PRECISIONS

    assert COMPILE_PRECISIONS == PRECISIONS


def test_profile_compiles_in_the_precision_asked_for(capsys, monkeypatch):
    # whether a group then computes in bf16 is measured per machine; the flag's job is to ask
    from opweave.frontends import torch_export

    asked = []
    real = torch_export.compile
    monkeypatch.setattr(torch_export, "compile",
                        lambda *a, **kw: asked.append(kw["precision"]) or real(*a, **kw))
    assert main(["profile", "xmlcnn", "--small", "--precision", "bf16", "--runs", "2",
                 "--warmup", "1"]) == 0
    assert asked == ["bf16"] and "opweave profile of xmlcnn" in capsys.readouterr().out
