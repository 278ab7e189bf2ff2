"""`make demo`: compile the five benchmark models and compare with eager PyTorch."""
from __future__ import annotations

import statistics
import time
import warnings

import torch

from . import models
from .frontends.torch_export import compile as compile_model

TOLERANCE = 1e-3


def _main_tensor(outputs) -> torch.Tensor:
    return outputs[0] if isinstance(outputs, (tuple, list)) else outputs


def max_abs_diff(a, b) -> float:
    flat_a = torch.utils._pytree.tree_flatten(a)[0]
    flat_b = torch.utils._pytree.tree_flatten(b)[0]
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(flat_a, flat_b))


def interleaved_medians(fns: dict, runs: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternation (A B A B ...) so that
    machine noise hits all of them alike."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        for _ in range(runs):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(names=models.BENCHMARK_SET, small: bool = False, runs: int = 10) -> list[dict]:
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"latency: median of {runs} interleaved runs, batch 1, fp32\n")
    header = f"{'model':<10} {'capture':<8} {'aten ops':>8} {'IR nodes':>8} {'coverage':>8} " \
             f"{'max|diff|':>10} {'compile s':>9} {'eager ms':>9} {'opweave ms':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name in names:
        bench = models.build(name, small=small)
        module = bench.module.eval()
        with torch.no_grad():
            reference = module(*bench.inputs)
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled = compile_model(module, bench.inputs, name=name)
            compile_s = time.perf_counter() - start
            diff = max_abs_diff(reference, compiled(*bench.inputs))
        times = interleaved_medians({"eager": lambda: module(*bench.inputs),
                                     "opweave": lambda: compiled(*bench.inputs)}, runs)
        cov = compiled.coverage
        row = dict(model=name, capture=compiled.capture, aten_ops=cov.total,
                   ir_nodes=cov.ir_nodes, coverage=cov.share, max_abs_diff=diff,
                   compile_s=compile_s, eager_ms=times["eager"] * 1e3,
                   opweave_ms=times["opweave"] * 1e3, fallbacks=dict(cov.fallback))
        rows.append(row)
        print(f"{name:<10} {row['capture']:<8} {row['aten_ops']:>8} {row['ir_nodes']:>8} "
              f"{row['coverage']:>8.1%} {diff:>10.2e} {compile_s:>9.1f} {row['eager_ms']:>9.2f} "
              f"{row['opweave_ms']:>10.2f} {row['eager_ms'] / row['opweave_ms']:>5.2f}x", flush=True)
    bad = [r["model"] for r in rows if r["max_abs_diff"] > TOLERANCE]
    print(f"\nratio = eager / opweave (above 1: opweave faster). All outputs within "
          f"{TOLERANCE:g} of eager." if not bad else f"\nOUTSIDE TOLERANCE: {', '.join(bad)}")
    return rows
