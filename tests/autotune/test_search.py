"""Whole-graph configurations: keyed by structure, searched by `opweave tune MODEL` in
worker processes (a crashing candidate fails alone, an interrupted search resumes), and
used by the next compile unless the caller chose the knobs."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch

import opweave
from opweave.ir.text import parse_graph
from opweave.options import Options
from opweave.autotune import search
from opweave.tune import configs, open_db
from opweave.tune.target import describe, target_id

GRAPH = """graph @{name}(%x: f32[2,{n}]) {{
  %y: f32[2,{n}] = relu(%x){loc}
  %z: f32[2,{n}] = neg(%y)
  return %z
}}
"""


def test_the_graph_key_sees_structure_not_names_or_locations():
    key = configs.graph_key(parse_graph(GRAPH.format(name="a", n=4, loc="")))[0]
    renamed = parse_graph(GRAPH.format(name="b", n=4, loc=' loc("model.py:3")')
                          .replace("%y", "%hidden"))
    assert configs.graph_key(renamed)[0] == key
    assert configs.graph_key(parse_graph(GRAPH.format(name="a", n=5, loc="")))[0] != key
    swapped = GRAPH.format(name="a", n=4, loc="").replace("relu(%x)", "tanh(%x)")
    assert configs.graph_key(parse_graph(swapped))[0] != key


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8)).eval()


def test_a_recorded_configuration_is_used_reported_and_overridden(tmp_path, monkeypatch):
    model, x = _model(), torch.randn(4, 16)
    monkeypatch.setenv("OPWEAVE_TUNING_DB", str(tmp_path / "t.sqlite"))  # for explain
    options = Options(tuning_db=str(tmp_path / "t.sqlite"), tuned=True)
    first = opweave.compile(model, (x,), options=options)
    (graph,) = first.program.compiled_graphs
    assert graph.report("tuned") is None and graph.options.fusion == "ilp"
    tuned = {"rewrite": "off", "fusion": "off"}
    configs.remember([graph.key], tuned, 1e-3, {"rewrite=off fusion=off": [1e-3]},
                     open_db(options.tuning_db))

    again = opweave.compile(model, (x,), options=options)
    (graph,) = again.program.compiled_graphs
    assert "rewrite=off fusion=off from the tuning database" in graph.report("tuned")
    assert graph.options.fusion == "off" and graph.options.rewrite.engine == "off"
    assert graph.report("lower").startswith("fusion off: one step per op")
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    report = str(opweave.explain(model, (x,), graph_breaks=False))
    assert "; rewrite=off fusion=off from the tuning database" in report

    chosen = opweave.compile(model, (x,), fusion="ilp", options=options)  # the caller decides
    (graph,) = chosen.program.compiled_graphs
    assert graph.report("tuned") is None and graph.options.fusion == "ilp"
    written = opweave.compile(model, (x,), options=Options(tuning_db=options.tuning_db))
    assert written.program.compiled_graphs[0].report("tuned") is None  # Options(...) as given
    from_env = opweave.compile(model, (x,))  # options from the environment: tuned
    assert "fusion=off" in from_env.program.compiled_graphs[0].report("tuned")


def test_a_tuned_configuration_keeps_the_callers_other_rewrite_settings(tmp_path):
    from opweave.passes.rewrite.pipeline import RewriteOptions
    from opweave.pipeline import _tuned_options

    graph = parse_graph(GRAPH.format(name="a", n=4, loc=""))
    key = configs.graph_key(graph)
    db_path = str(tmp_path / "t.sqlite")
    configs.remember([key], {"rewrite": "greedy", "fusion": "greedy"}, 1e-3, {}, open_db(db_path))
    mine = RewriteOptions(rulesets=("algebra",), ilp_seconds=1.5)
    options = Options(rewrite=mine, tuning_db=db_path, tuned=True)
    tuned, report = _tuned_options(graph, key[0], options)
    assert tuned.rewrite.extractor == "greedy" and tuned.fusion == "greedy"
    assert tuned.rewrite.rulesets == ("algebra",) and tuned.rewrite.ilp_seconds == 1.5
    assert report.name == "tuned"


def test_an_unreadable_database_compiles_untuned_with_a_warning(tmp_path):
    from opweave import notices
    from opweave.pipeline import TuningWarning, _tuned_options

    graph = parse_graph(GRAPH.format(name="a", n=4, loc=""))
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    options = Options(tuning_db=str(blocker / "t.sqlite"), tuned=True)
    notices._WARNED.clear()
    with pytest.warns(TuningWarning, match="could not be read"):
        assert _tuned_options(graph, "k", options) == (options, None)


def test_the_environment_can_turn_tuned_configurations_off():
    assert Options.from_env({}).tuned
    assert not Options.from_env({"OPWEAVE_TUNED": "0"}).tuned
    assert not Options.from_env({"OPWEAVE_FUSION": "greedy"}).tuned
    assert not Options.resolve(Options(), rewrite="greedy").tuned


# A stand-in worker: known times per configuration, and a crash (abort) for fusion=greedy.
FAKE_WORKER = textwrap.dedent("""
    import json, os, sys
    request = json.load(open(sys.argv[1]))
    with open(os.environ["FAKE_WORKER_LOG"], "a") as log:
        log.write(json.dumps(request["configs"]) + "\\n")
    results = []
    for config in request["configs"]:
        if config["fusion"] == "greedy":
            os.abort()
        if config == {"rewrite": "off", "fusion": "ilp"}:  # a compile that raises
            results.append({"config": config, "error": "RuntimeError: cannot lower"})
            continue
        ms = {"eqsat": 3.0, "greedy": 2.0, "off": 4.0}[config["rewrite"]]
        ms += {"ilp": 0.0, "off": 0.5}[config["fusion"]]
        results.append({"config": config, "samples": [ms / 1e3] * request["rounds"],
                        "max_abs_diff": 0.0, "graph_keys": [["k" * 32, "graph (f32[2]) of 2 nodes"]]})
    json.dump({"model": request["model"], "results": results}, open(sys.argv[2], "w"))
""")


@pytest.fixture
def fake_worker(tmp_path, monkeypatch):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    log = tmp_path / "requests.log"
    monkeypatch.setenv("FAKE_WORKER_LOG", str(log))
    monkeypatch.setattr(search, "WORKER", [sys.executable, str(script)])
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


def test_the_search_finds_the_best_survives_crashes_and_resumes(tmp_path, fake_worker):
    db = open_db(tmp_path / "t.sqlite")
    lines = []
    result = search.tune_model("xmlcnn", db, small=True, rounds=3, progress=lines.append)
    assert result.best.config == {"rewrite": "greedy", "fusion": "ilp"}
    assert result.baseline.config == configs.DEFAULT
    crashed = [t for t in result.trials if t.transient]
    assert {t.config["fusion"] for t in crashed} == {"greedy"} and len(crashed) == 3
    assert all("exited with status" in t.error for t in crashed)
    (raised,) = [t for t in result.trials if t.error and not t.transient]
    assert raised.config == {"rewrite": "off", "fusion": "ilp"} and "cannot lower" in raised.error
    assert len(result.trials) == len(configs.all_configs())  # the whole space, each once
    record = db.get(configs.KIND, "k" * 32, target_id(describe()))
    assert record.config == {"rewrite": "greedy", "fusion": "ilp"}
    assert configs.recall("k" * 32, db).seconds == pytest.approx(2e-3)
    assert any(line.startswith("confirming") for line in lines)

    requests = len(fake_worker())
    again = search.tune_model("xmlcnn", db, small=True, rounds=3)
    # measured again: the baseline and the three whose worker died (perhaps the machine's
    # doing); read back: the four measured and the one whose compile raised
    remeasured = [t.config for t in again.trials if not t.resumed]
    assert len(remeasured) == 4 and configs.DEFAULT in remeasured
    assert len(fake_worker()) == requests + 5  # those four and the confirmation
    assert again.best.config == result.best.config


def test_a_trial_budget_stops_the_search(tmp_path, fake_worker):
    result = search.tune_model("xmlcnn", open_db(tmp_path / "t.sqlite"), small=True, trials=3,
                               rounds=2)
    assert sum(not t.resumed for t in result.trials) == 3


def test_tuning_a_real_model_records_a_configuration_the_next_compile_uses(tmp_path):
    """The real worker on the small XML-CNN, two trials: the record it writes is found by
    `opweave.compile` on the same model (same graph key in another process)."""
    from opweave.models import build

    db_path = tmp_path / "t.sqlite"
    db = open_db(db_path)
    result = search.tune_model("xmlcnn", db, small=True, trials=2, rounds=2, confirm=2)
    assert not result.baseline.error and result.best.samples
    bench = build("xmlcnn", small=True)
    compiled = opweave.compile(bench.module.eval(), bench.inputs,
                               options=Options(tuning_db=str(db_path), tuned=True))
    (graph,) = compiled.program.compiled_graphs
    assert configs.describe_config(result.best.config) in graph.report("tuned")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*bench.inputs), bench.module(*bench.inputs))


def test_a_tuning_worker_measures_and_records_its_kernels_schedules(tmp_path, monkeypatch):
    """The search's workers compile with kernels="tune": each generated kernel's schedules
    are measured in the worker and recorded, and a compile with the database builds them.
    Library forms by the cost model, no solver deadline: the plan, and so its one
    generated kernel (the embeddings' adds and layer norm), never depends on timing."""
    from opweave.models import build

    monkeypatch.setenv("OPWEAVE_MEASURE", "0")
    monkeypatch.setenv("OPWEAVE_DETERMINISTIC", "1")
    db_path = tmp_path / "t.sqlite"
    request = {"model": "bert-base", "small": True, "threads": 1, "rounds": 1,
               "tuning_db": str(db_path), "kernels": "tune", "configs": [dict(configs.DEFAULT)]}
    (trial,) = search.run_worker(request, timeout=600)
    assert not trial.error and trial.samples
    (record,) = [r for r in open_db(db_path).records() if r.kind == "kernel-schedule"]
    assert len(record.samples) > 1 and record.config["form"] in record.samples

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's thread count is part of the record's target
    try:
        bench = build("bert-base", small=True)
        compiled = opweave.compile(bench.module.eval(), bench.inputs,
                                   options=Options(tuning_db=str(db_path), measure=False,
                                                   deterministic=True))
    finally:
        torch.set_num_threads(threads)
    (kernel,) = [s for s in compiled.program.steps[0].executor.lowered_steps if s.kind == "cpp"]
    # the record is keyed by the default source's name: the step runs it, or the winner
    rescheduled = record.config["form"] != "threads=auto vector=auto"
    assert (kernel.name in record.workload_text) != rescheduled
    assert ("on tuned schedules" in compiled.program.compiled_graphs[0].report("lower")) \
        == rescheduled


def test_the_command_line(tmp_path, fake_worker, capsys):
    from opweave.cli import main

    db = str(tmp_path / "t.sqlite")
    assert main(["tune", "no-such-model", "--db", db]) == 2
    assert "neither show, stats, export, import, ranker, machine nor a model" in capsys.readouterr().err
    assert main(["tune", "export", "--db", db]) == 2
    assert main(["tune", "xmlcnn", "--small", "--trials", "2", "--rounds", "2", "--db", db]) == 0
    out = capsys.readouterr().out
    assert "trial 2:" in out and "xmlcnn: rewrite=" in out
    assert main(["tune", "show", "--db", db]) == 0
    assert "graph-config" in capsys.readouterr().out


def test_tuning_the_torch_compile_path_records_what_torch_compile_uses(tmp_path, monkeypatch):
    """torch.compile's (AOTAutograd, frozen) graphs differ from opweave.compile's, so they
    are tuned through that path; the next torch.compile of the model finds the record."""
    from opweave.frontends import torch_dynamo
    from opweave.models import build

    db_path = tmp_path / "t.sqlite"
    result = search.tune_model("xmlcnn", open_db(db_path), small=True, trials=2, rounds=2,
                               confirm=2, dynamo=True)
    assert result.model == "xmlcnn via torch.compile"
    monkeypatch.setenv("OPWEAVE_TUNING_DB", str(db_path))
    bench = build("xmlcnn", small=True)
    torch._dynamo.reset()
    mark = torch_dynamo.compiled_graphs.mark()
    compiled = torch.compile(bench.module.eval(), backend="opweave")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*bench.inputs), bench.module(*bench.inputs))
    (program,) = torch_dynamo.compiled_graphs.since(mark)
    (graph,) = program.compiled_graphs
    assert configs.describe_config(result.best.config) in graph.report("tuned")
    torch._dynamo.reset()
