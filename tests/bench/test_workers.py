"""Real worker processes on small models: each backend kind end to end, and the isolation
that lets backends alternate without slowing each other."""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

from opweave.bench import harness, report
from opweave.bench.worker import BackendUnavailable, Worker, WorkerSpec


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spec(backend, model="xmlcnn", mode="infer"):
    return WorkerSpec(model=model, mode=mode, threads=2, small=True, backend=backend)


def test_inference_through_the_harness(tmp_path, monkeypatch):
    """Every kind of inference backend on one small model: opweave directly and through
    torch.compile, and the peers (OpenVINO only where it is installed: an optional extra)."""
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    # a private cache would make every worker build the native runtime (40 s each)
    monkeypatch.setenv("OPWEAVE_NATIVE", "off")
    peers = ["onnxruntime"] + (["openvino"] if importlib.util.find_spec("openvino") else [])
    config = harness.BenchConfig(models=["xmlcnn"], backends=["opweave", "opweave-dynamo", *peers],
                                 runs=3, warmup=1, threads=2, small=True)
    result = harness.run(config)
    entries = result.models[0].backends
    for name in ("eager", "opweave", "opweave-dynamo", *peers):
        assert entries[name].ok, entries[name].reason
        assert entries[name].summary.count == 3
        assert entries[name].max_abs_diff < 1e-4
        assert entries[name].peak_rss > 0
    assert entries["opweave"].torch_peak > 0 and entries["onnxruntime"].torch_peak is None
    assert "gather + max" in entries["onnxruntime"].note  # the exportable formulation
    assert "1 graph, 1 with frozen weights" in entries["opweave-dynamo"].note
    if "openvino" in peers:
        assert "inference precision f32" in entries["openvino"].note
    assert result.models[0].flops > 0 and result.machine["gemm_peak_flops"] > 0
    assert report.terminal(result).splitlines()[1].startswith("CPU: ")


def test_int8_backends_through_the_harness(tmp_path, monkeypatch):
    """opweave and ONNX Runtime statically quantized, both calibrated on the benchmark's
    inputs, held to int8's tolerance and labelled so in the report."""
    pytest.importorskip("onnxruntime")  # a peer: the optional "peers" extra
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OPWEAVE_NATIVE", "off")
    monkeypatch.setenv("OPWEAVE_MEASURE", "0")  # the int8 forms, whichever is faster here
    config = harness.BenchConfig(models=["xmlcnn"], backends=["opweave-int8", "onnxruntime-int8"],
                                 runs=2, warmup=1, threads=2, small=True)
    result = harness.run(config)
    entries = result.models[0].backends
    for name in ("opweave-int8", "onnxruntime-int8"):
        assert entries[name].ok, entries[name].reason
        assert entries[name].accurate(harness.TOLERANCE["infer"])
        assert 0 < entries[name].rel_l2_diff <= harness.LOW_PRECISION_REL_L2["int8"]
    assert "linear/convolution steps in int8" in entries["opweave-int8"].note
    assert "quantize_static" in entries["onnxruntime-int8"].note
    text = report.markdown(result)
    assert "int8 where a backend is named *-int8" in text and "*-int8 backends compute" in text


def test_openvino_default_precision_is_labelled():
    pytest.importorskip("openvino")
    with Worker(_spec("openvino-default")) as worker:
        note = worker.call("prepare")["note"]
    assert "OpenVINO's default precision: " in note  # f32, or bf16 on CPUs with bf16 units


def test_missing_openvino_is_unavailable_not_an_error(monkeypatch):
    from opweave.bench import backends
    from opweave.models import build

    monkeypatch.setitem(sys.modules, "openvino", None)  # import fails as if not installed
    bench = build("xmlcnn", small=True)
    for name in ("openvino", "openvino-default"):
        with pytest.raises(backends.Unavailable, match="OpenVINO is not installed"):
            backends.prepare(name, bench, "infer", 1)


def test_training_step_gradients_match_eager():
    with Worker(_spec("eager", mode="train")) as eager, \
            Worker(_spec("opweave", mode="train")) as opweave:
        expected = eager.call("prepare")["outputs"]
        got = opweave.call("prepare")["outputs"]
        assert len(got) == len(expected) > 2  # the loss, then one gradient per parameter
        assert harness.max_abs_diff(got, expected) < 1e-4
        assert len(opweave.call("run", 2)) == 2


def test_inference_only_backend_refuses_training_with_a_reason():
    with Worker(_spec("onnxruntime", mode="train")) as worker:
        with pytest.raises(BackendUnavailable, match="inference backend"):
            worker.call("prepare")


def test_worker_errors_carry_the_traceback():
    with Worker(_spec("eager")) as worker:
        with pytest.raises(Exception, match="AttributeError"):
            worker.call("run", 1)  # not prepared yet


def test_spinning_runtime_is_quiet_when_its_call_returns():
    """ONNX Runtime's pool threads spin after each run (its default, kept for speed); the
    worker answers only once they stopped, so the next backend has the cores to itself.
    Holds under load too (the suite runs on both cores), where a spinner is descheduled."""
    with Worker(_spec("onnxruntime", model="resnet50")) as worker:
        worker.call("prepare")
        for _ in range(3):
            worker.call("run", 3)
            before = _cpu_seconds(worker.pid)
            time.sleep(0.3)
            assert _cpu_seconds(worker.pid) - before < 0.02
