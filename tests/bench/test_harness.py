"""The harness's orchestration with fake workers: interleaving, failures, accuracy,
reports. No model runs here; `test_workers.py` runs real ones."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from opweave.bench import harness, report
from opweave.bench.worker import BackendUnavailable, WorkerError


class FakeWorker:
    """Stands in for a worker process; records every call in a shared log."""

    log: list = []
    behaviour: dict = {}  # backend -> dict(seconds=..., outputs=..., prepare_error=...)

    def __init__(self, spec):
        self.spec = spec
        self.closed = False

    def call(self, command, *args, timeout=None):
        b = self.spec.backend
        FakeWorker.log.append((b, command, *args))
        conf = FakeWorker.behaviour.get(b, {})
        if command == "gemm_peak":
            if conf.get("calibration_crash"):
                raise WorkerError("Traceback\nSegmentation fault")
            return 100e9
        if command == "flops":
            return 2e9
        if command == "notes":
            return "fake model"
        if command == "prepare":
            if "prepare_error" in conf:
                raise conf["prepare_error"]
            return dict(setup_s=1.5, outputs=conf.get("outputs", [np.ones((2, 3), np.float32)]),
                        note=conf.get("note", ""), torch_memory=True)
        if command == "run":
            if conf.get("crash_on_run"):
                raise WorkerError("Traceback ...\nRuntimeError: boom")
            if "per_run" in conf:  # one call's seconds for each run in turn
                return [conf["per_run"].pop(0)] * args[0]
            seconds = conf.get("seconds", 0.01)  # one call's, or each call's of a run
            if isinstance(seconds, list):
                return seconds[:args[0]]
            return [seconds] * args[0]
        if command == "memory":
            return dict(peak_rss=200 << 20, torch_peak=10 << 20)
        raise AssertionError(command)

    def close(self):
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("OPWEAVE_CACHE_DIR", str(tmp_path / "cache"))
    FakeWorker.log = []
    FakeWorker.behaviour = {}
    return FakeWorker


def _config(**kw):
    base = dict(models=["m1", "m2"], backends=["inductor", "opweave"], runs=4, warmup=1)
    return harness.BenchConfig(**{**base, **kw})


def test_backends_are_timed_interleaved_one_call_at_a_time(fake):
    fake.behaviour = {"eager": dict(seconds=0.02), "inductor": dict(seconds=0.01),
                      "opweave": dict(seconds=0.005)}
    result = harness.run(_config(), worker_factory=fake)
    timed = [b for b, c, *_ in fake.log if c == "run"]
    # warm-up: one call each; then 4 rounds per model in a Williams square's orders (each
    # backend after each other alike), never the same twice in a row
    per_model = timed[: len(timed) // 2]
    assert per_model[3:] == ["eager", "inductor", "opweave", "inductor", "opweave", "eager",
                             "opweave", "eager", "inductor", "opweave", "inductor", "eager"]
    m1 = result.models[0]
    assert m1.speedup_over_eager("opweave") == pytest.approx(4.0)
    assert m1.ratios()["opweave"]["inductor"] == pytest.approx(2.0)
    assert result.geomean_speedup("inductor") == pytest.approx(2.0)
    assert m1.backends["opweave"].summary.count == 4
    assert m1.flops == 2e9 and result.machine["gemm_peak_flops"] == 100e9


def test_calls_in_a_row_are_timed_without_the_first(fake):
    # the first call after the other backends ran pays for the pause; with calls=N a
    # sample is the mean of the N - 1 calls after it, and the first is kept apart
    fake.behaviour = {"eager": dict(seconds=[0.05, 0.02, 0.02, 0.02]),
                      "opweave": dict(seconds=[0.03, 0.004, 0.005, 0.009])}
    result = harness.run(_config(models=["m1"], backends=["opweave"], calls=4),
                         worker_factory=fake)
    timed = [args for b, c, *args in fake.log if c == "run"]
    assert timed[:2] == [[1], [1]]  # the warm-up: one call each
    assert all(args == [4, 0.0] for args in timed[2:]) and len(timed[2:]) == 8
    entries = result.models[0].backends
    assert entries["opweave"].samples == pytest.approx([0.006] * 4)
    assert entries["opweave"].first_calls == pytest.approx([0.03] * 4)
    assert entries["eager"].samples == pytest.approx([0.02] * 4)
    assert report.to_json(result)["config"]["calls"] == 4
    text = report.terminal(result)
    assert "each run 4 calls back to back, its sample the mean of all but the first" in text
    assert "its first call, which pays the slow first work of idle vCPUs" in text


def test_a_run_of_several_calls_counts_them_all_in_the_budget(fake):
    fake.behaviour = {"opweave": dict(seconds=0.01)}
    result = harness.run(_config(models=["m1"], backends=["opweave"], calls=4, runs=4,
                                 seconds_per_backend=0.13), worker_factory=fake)
    entry = result.models[0].backends["opweave"]
    assert entry.summary.count == 3 and "3 runs (slow)" in entry.note


def test_calls_per_run_below_one_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        _config(calls=0)


def test_one_call_per_run_keeps_the_pause(fake):
    fake.behaviour = {"opweave": dict(seconds=[0.03, 0.005])}
    result = harness.run(_config(models=["m1"], backends=["opweave"]), worker_factory=fake)
    entry = result.models[0].backends["opweave"]
    assert entry.samples == pytest.approx([0.03] * 4) and entry.first_calls == []
    assert "so each pays the slow first work of idle vCPUs" in report.terminal(result)


def test_a_pause_goes_before_every_timed_call_and_into_the_budget_and_report(fake):
    fake.behaviour = {"eager": dict(seconds=0.01), "opweave": dict(seconds=0.01)}
    result = harness.run(_config(models=["m1"], backends=["opweave"], pause_ms=20.0, runs=4,
                                 seconds_per_backend=0.13), worker_factory=fake)
    timed = [args for b, c, *args in fake.log if c == "run"]
    assert timed[:2] == [[1], [1]]  # the warm-up: one call each, no pause
    assert all(args == [1, 0.02] for args in timed[2:])
    assert result.models[0].backends["opweave"].summary.count == 4
    assert report.to_json(result)["config"]["pause_ms"] == 20.0
    text = report.terminal(result)
    assert "each call after a 20 ms pause of its process" in text
    assert "and each call after a further 20 ms pause" in text
    # a run costs its call and its pause: 0.04 s, so 0.13 s holds 3 runs (13 calls alone)
    slow = harness.run(_config(models=["m1"], backends=["opweave"], pause_ms=30.0, runs=4,
                               seconds_per_backend=0.13), worker_factory=fake)
    assert "3 runs (slow)" in slow.models[0].backends["opweave"].note


def test_a_negative_pause_is_refused():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="0 ms or more"):
            _config(pause_ms=bad)


def test_several_calls_after_a_pause_each_are_said_so(fake):
    fake.behaviour = {"opweave": dict(seconds=0.01)}
    result = harness.run(_config(models=["m1"], backends=["opweave"], calls=3, pause_ms=5.0),
                         worker_factory=fake)
    assert ("; each run 3 calls, its sample the mean of all but the first; each call after "
            "a 5 ms pause of its process") in report.terminal(result)


def test_the_worker_sleeps_the_pause_before_each_call():
    starts = []
    session = _session(lambda: starts.append(time.perf_counter()))
    before = time.perf_counter()
    assert len(session.run(3, 0.02)) == 3
    gaps = np.diff([before, *starts])
    assert (gaps >= 0.02).all(), gaps  # a sleep lasts at least what it was asked for


def _session(step, caller="main"):
    """A worker's session around `step`, without a model (no torch, no build)."""
    from types import SimpleNamespace

    from opweave.bench import worker

    session = worker._Session.__new__(worker._Session)
    session.spec = worker.WorkerSpec(model="m", caller=caller)
    session.prepared, session._caller_thread = SimpleNamespace(step=step), None
    return session


@pytest.mark.parametrize("caller", ["main", "thread"])
def test_the_caller_thread_makes_every_call_of_its_worker(caller):
    import threading

    callers = []
    session = _session(lambda: callers.append(threading.get_ident()), caller)
    assert len(session.run(2)) == 2 and len(session.run(3)) == 3
    if session._caller_thread is not None:
        session._caller_thread.shutdown()
    if caller == "main":
        assert set(callers) == {threading.get_ident()}
    else:  # one thread, not this one, for all five: a server's handler thread
        assert len(set(callers)) == 1 and callers[0] != threading.get_ident()


def test_peers_workers_start_without_opweaves_libgomp_waits(monkeypatch):
    from opweave.bench.worker import _peer_environment

    monkeypatch.delenv("OPWEAVE_OPENMP_WAITS", raising=False)
    for backend, inside in (("eager", "system"), ("inductor-bf16", "system"),
                            ("opweave-bf16", None), (None, None)):
        with _peer_environment(backend):
            assert os.environ.get("OPWEAVE_OPENMP_WAITS") == inside, backend
        assert "OPWEAVE_OPENMP_WAITS" not in os.environ
    monkeypatch.setenv("OPWEAVE_OPENMP_WAITS", "spin")
    with _peer_environment("openvino"):
        assert os.environ["OPWEAVE_OPENMP_WAITS"] == "system"
    assert os.environ["OPWEAVE_OPENMP_WAITS"] == "spin"


def test_a_thread_caller_is_said_in_the_report_and_an_unknown_one_refused(fake):
    fake.behaviour = {"opweave": dict(seconds=0.01)}
    result = harness.run(_config(models=["m1"], backends=["opweave"], caller="thread"),
                         worker_factory=fake)
    assert ("; each call made by a second thread of its process, the one that prepared the "
            "model staying idle") in report.terminal(result)
    assert report.to_json(result)["config"]["caller"] == "thread"
    with pytest.raises(ValueError, match="the caller must be one of main, thread"):
        _config(caller="server")


def test_eager_is_always_the_reference_even_when_not_asked(fake):
    config = _config(backends=["opweave"])
    assert config.ordered_backends() == ["eager", "opweave"]
    result = harness.run(config, worker_factory=fake)
    assert result.models[0].backends["eager"].max_abs_diff == 0.0


def test_unavailable_and_crashing_backends_are_reported_not_dropped(fake):
    fake.behaviour = {
        "inductor": dict(prepare_error=BackendUnavailable("cannot export: adaptive pooling")),
        "opweave": dict(crash_on_run=True)}
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    entries = result.models[0].backends
    assert entries["inductor"].status == "unavailable"
    assert "adaptive pooling" in entries["inductor"].reason
    assert entries["opweave"].status == "error" and "boom" in entries["opweave"].reason
    assert entries["eager"].ok and not entries["opweave"].ok
    text = report.terminal(result)
    assert "cannot export: adaptive pooling" in text and "boom" in text


def test_wrong_outputs_are_flagged(fake):
    fake.behaviour = {"opweave": dict(outputs=[np.full((2, 3), 1.5, np.float32)]),
                      "inductor": dict(outputs=[np.ones((3, 2), np.float32)])}
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    entries = result.models[0].backends
    assert entries["opweave"].max_abs_diff == pytest.approx(0.5)
    assert "!" in report.terminal(result)
    assert result.geomean_speedup("opweave") is None  # a fast wrong answer is no speed-up
    assert entries["inductor"].status == "error" and "shape" in entries["inductor"].reason


def test_slow_backend_gets_fewer_runs_within_budget(fake):
    fake.behaviour = {"opweave": dict(seconds=20.0)}
    result = harness.run(_config(models=["m1"], runs=10, seconds_per_backend=60),
                         worker_factory=fake)
    entries = result.models[0].backends
    assert entries["eager"].summary.count == 10
    assert entries["opweave"].summary.count == 3 and "3 runs (slow)" in entries["opweave"].note


def test_reports_written_with_raw_samples(fake, tmp_path):
    fake.behaviour = {"opweave": dict(seconds=0.005, note="dense adjacency")}
    result = harness.run(_config(), worker_factory=fake)
    paths = report.write_all(result, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["format"] == "opweave-bench/1"
    assert data["machine"]["threads"] == result.config.threads
    samples = data["models"][0]["backends"]["opweave"]["samples"]
    assert samples == [0.005] * 4
    assert data["geomean_speedup_over_eager"]["opweave"] == pytest.approx(2.0)
    md = paths["md"].read_text()
    assert "| m1 |" in md and "2.00x" in md and "dense adjacency" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    # roofline: 2 GFLOP in 5 ms on a 100 GFLOP/s peak = 400 %
    header, rows = report.detail_rows(result)
    row = next(r for r in rows if r[:2] == ["m1", "opweave"])
    assert row[header.index("% GEMM peak")] == "400.0"


def test_max_abs_diff():
    a = [np.zeros((2,), np.float32), np.array([1.0, 2.0], np.float32)]
    b = [np.zeros((2,), np.float32), np.array([1.0, 2.5], np.float32)]
    assert harness.max_abs_diff(a, b) == pytest.approx(0.5)
    nan, inf = np.float32("nan"), np.float32("inf")
    assert harness.max_abs_diff([np.array([nan, 1.0])], [np.array([0.0, 1.0])]) == float("inf")
    assert harness.max_abs_diff([np.array([inf, 1.0])], [np.array([5.0, 1.0])]) == float("inf")
    assert harness.max_abs_diff([np.array([nan, inf, 1.0])], [np.array([nan, inf, 1.5])]) == 0.5
    with pytest.raises(ValueError, match="outputs"):
        harness.max_abs_diff(a[:1], b)


def test_report_survives_a_failed_reference(fake):
    fake.behaviour = {"eager": dict(prepare_error=WorkerError("Traceback\nOSError: no memory"))}
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    assert result.models[0].backends["eager"].status == "error"
    assert result.models[0].speedup_over_eager("opweave") is None
    text = report.terminal(result)
    assert "no memory" in text and "error" in text
    report.markdown(result)


def test_a_failed_calibration_drops_only_the_roofline(fake):
    fake.behaviour = {None: dict(calibration_crash=True)}
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    assert result.machine["gemm_peak_flops"] is None
    assert "Segmentation fault" in result.machine["gemm_peak_error"]
    assert result.models[0].backends["opweave"].ok
    header, rows = report.detail_rows(result)
    assert all(r[header.index("% GEMM peak")] == "-" for r in rows)
    report.terminal(result)


def test_every_backend_declares_both_modes():
    from opweave.bench.backends import BACKENDS, PREPARE
    from opweave.bench.modes import INFER, TRAIN

    assert {"opweave-dynamo", "openvino", "openvino-default"} <= set(BACKENDS)
    assert all(set(PREPARE[name]) == {INFER, TRAIN} for name in BACKENDS)
    # opweave-dynamo runs both; the OpenVINO backends refuse training with a reason
    assert PREPARE["opweave-dynamo"][INFER].__name__ == "_infer_opweave_dynamo"
    assert PREPARE["openvino"][TRAIN].__name__ == "prepare"


def test_reports_name_the_cpu(fake, tmp_path):
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    cpu = result.machine["cpu_info"]
    assert cpu["cpu"] and cpu["threads"] == result.config.threads
    assert cpu["logical_cpus"] >= 1 and isinstance(cpu["features"], list)
    line = report.terminal(result).splitlines()[1]
    assert line.startswith(f"CPU: {cpu['cpu']}") and f"{cpu['threads']} threads" in line
    paths = report.write_all(result, tmp_path)
    assert f"- {line}" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["machine"]["cpu_info"] == cpu


def test_cpu_line_names_the_isa_and_counts():
    from opweave.bench import cpu

    blocks = [{"physical id": "0", "core id": str(i % 4)} for i in range(8)]  # 4 cores, SMT
    assert cpu.physical_cores(blocks) == 4 and cpu.physical_cores([{}]) is None
    line = cpu.line(dict(cpu="Intel(R) Xeon(R) Platinum 8480+", cpu_id="GenuineIntel cpu family 6",
                         features=["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
                         torch_isa="AVX512", physical_cores=4, logical_cpus=8, threads=4))
    assert line == ("CPU: Intel(R) Xeon(R) Platinum 8480+ (GenuineIntel cpu family 6); "
                    "ISA avx2 avx512f avx512_bf16 amx_bf16 (torch kernels: AVX512); "
                    "4 cores, 8 logical CPUs; 4 threads")


def test_opweave_is_compared_with_the_fastest_peer_round_by_round(fake, tmp_path):
    """The phases of a noisy machine: each round's ratio counts, not two medians. Here
    opweave is 0.9x inductor's time in every round, though rounds vary 2x."""
    phases = [0.010, 0.020, 0.011, 0.019, 0.010, 0.021, 0.012, 0.020]
    fake.behaviour = {"eager": dict(seconds=0.05),
                      "inductor": dict(per_run=[0.01] + phases),  # the warm-up call first
                      "opweave": dict(per_run=[0.01] + [0.9 * t for t in phases])}
    result = harness.run(_config(models=["m1"], runs=8), worker_factory=fake)
    m1 = result.models[0]
    assert m1.backends["opweave"].rounds == list(range(8))
    (model, paired), = result.against_peers()
    assert (model, paired.backend, paired.other, paired.runs) == ("m1", "opweave", "inductor", 8)
    assert paired.median == pytest.approx(0.9) and paired.high == pytest.approx(0.9)
    assert paired.verdict == "faster" and paired.coverage > 0.95
    text = report.terminal(result)
    assert "m1: opweave / inductor: 0.900 (median of 8 rounds; 99% interval 0.900-0.900): faster" \
        in text
    data = json.loads(report.write_all(result, tmp_path / "out")["json"].read_text())
    assert data["against_peers"][0]["verdict"] == "faster"


def test_ratios_that_straddle_one_are_level_and_pairs_are_by_round(fake):
    ratios = [0.9, 1.1, 0.95, 1.05, 1.0, 0.97, 1.03, 1.02]
    fake.behaviour = {"inductor": dict(per_run=[0.01] + [0.01] * 8),
                      "opweave": dict(per_run=[0.01] + [0.01 * r for r in ratios])}
    result = harness.run(_config(models=["m1"], runs=8), worker_factory=fake)
    (_, paired), = result.against_peers()
    assert paired.verdict == "level" and paired.low < 1 < paired.high
    m1 = result.models[0]
    # a backend with fewer runs pairs only the rounds it ran in
    m1.backends["inductor"].samples, m1.backends["inductor"].rounds = [0.02, 0.02], [1, 5]
    paired = m1.paired("opweave", "inductor")
    assert paired.runs == 2 and paired.median == pytest.approx((1.1 + 0.97) / 4)


def test_a_wrong_peer_is_not_the_one_to_beat(fake):
    fake.behaviour = {"inductor": dict(seconds=0.001, outputs=[np.zeros((2, 3), np.float32)]),
                      "opweave": dict(seconds=0.01)}
    result = harness.run(_config(models=["m1"]), worker_factory=fake)
    (_, paired), = result.against_peers()
    assert paired.other == "eager"
