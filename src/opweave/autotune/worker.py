"""A tuning worker: compiles one model under the given whole-graph configurations and
times them, in a process of its own, so a configuration that crashes or hangs the
compiler kills only its worker (`python -m opweave.autotune.worker REQUEST.json RESULT.json`).

The request names the model (`opweave.models.build`), the path it is compiled through
(`opweave.compile`, or `torch.compile(backend="opweave")` under no_grad, whose graphs
differ), the configurations, the rounds, the thread count, the tuning database and how
the generated kernels' schedules are chosen (`Options.kernels`). The configurations are timed interleaved, one call of each per round,
after checking each one's outputs against eager; the result gives, per configuration,
every sample, the largest difference from eager, the compile time and the graph keys
(tune/configs.py) its compile saw, or the error that stopped it.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from ..files import atomic_write

TOLERANCE = 1e-3  # largest absolute difference from eager, as `opweave bench` allows


def _max_abs_diff(got, expected) -> float:
    import torch

    leaves = torch.utils._pytree.tree_leaves
    pairs = list(zip(leaves(got), leaves(expected)))
    return max((float((g.float() - e.float()).abs().max()) if g.numel() else 0.0
                for g, e in pairs if isinstance(g, torch.Tensor)), default=0.0)


PATHS = ("export", "dynamo")  # opweave.compile, or torch.compile(backend="opweave")


def _compile(path: str, module, bench, config: dict, warmup: int):
    """(callable, its output after `warmup` calls, the graph keys it compiled), with
    `config` as the caller's explicit choice (so no tuned record replaces it)."""
    import torch

    if path == "dynamo":
        from ..frontends import torch_dynamo

        mark = torch_dynamo.compiled_graphs.mark()
        compiled = torch.compile(module, backend="opweave", options=dict(config))
        for _ in range(warmup):  # Dynamo compiles at the first call; then record, check
            out = compiled(*bench.inputs)
        programs = torch_dynamo.compiled_graphs.since(mark)
    else:
        from ..frontends.torch_export import compile as opweave_compile

        compiled = opweave_compile(module, bench.inputs, name=bench.name,
                                   rewrite=config["rewrite"], fusion=config["fusion"])
        for _ in range(warmup):  # record, check, then the native plan
            out = compiled(*bench.inputs)
        programs = [compiled.program] if compiled.program is not None else []
    keys = [list(g.key) for p in programs for g in p.compiled_graphs if g.key]
    return compiled, out, keys


def measure(request: dict) -> dict:
    import torch

    from ..models import build

    os.environ["OPWEAVE_NATIVE"] = "wait"  # timed calls run the native plan, never Python
    if request.get("tuning_db"):  # the kernels' measured choices go where the search's do
        os.environ["OPWEAVE_TUNING_DB"] = request["tuning_db"]
    # "tune": each generated kernel's schedule is measured at its first compile, recorded,
    # and built from then on (codegen/kernel_schedule.py)
    if "kernels" in request:
        os.environ["OPWEAVE_KERNELS"] = request["kernels"]
    if request.get("recheck"):  # recorded library forms measured again (Options.recheck)
        os.environ["OPWEAVE_RECHECK"] = "1"
    torch.set_num_threads(request["threads"])
    bench = build(request["model"], request.get("small", False))
    module = bench.module.eval()
    path = request.get("path", "export")
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; known: {', '.join(PATHS)}")
    results, calls = [], []
    with torch.no_grad():
        expected = module(*bench.inputs)
        for config in request["configs"]:
            start = time.perf_counter()
            try:
                compiled, out, keys = _compile(path, module, bench, config,
                                               request.get("warmup", 3))
            except Exception as err:  # noqa: BLE001  (reported as this configuration's failure)
                results.append({"config": config, "error": f"{type(err).__name__}: {err}"})
                calls.append(None)
                continue
            diff = _max_abs_diff(out, expected)
            results.append({"config": config, "compile_s": time.perf_counter() - start,
                            "max_abs_diff": diff, "graph_keys": keys, "samples": []})
            if diff > TOLERANCE:
                results[-1]["error"] = f"outputs differ from eager by {diff:.2e}"
                calls.append(None)
            else:
                calls.append(compiled)
        for _ in range(request.get("rounds", 10)):
            for compiled, result in zip(calls, results):
                if compiled is None:
                    continue
                start = time.perf_counter()
                compiled(*bench.inputs)
                result["samples"].append(time.perf_counter() - start)
    return {"model": request["model"], "results": results}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    try:
        result = measure(json.loads(Path(request_path).read_text()))
    except Exception:  # noqa: BLE001  (the driver reports the worker's traceback)
        result = {"error": traceback.format_exc()}
    atomic_write(result_path, lambda tmp: tmp.write_text(json.dumps(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
