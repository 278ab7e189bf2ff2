"""`opweave bench --accuracy`: each precision's error against a float64 reference.

The reference is the same model run by eager PyTorch in float64 (weights and floating
inputs widened). Against it: eager float32 (float32's own error: the floor any float32
compiler stands on), opweave in float32, and opweave in each lower precision. Errors are
over all outputs together: the largest absolute difference, the relative L2 difference
(||got - ref|| / ||ref||) and the scale of the outputs (max |ref|) to read them against;
and each mode's agreement with eager float32 (cosine similarity of all outputs).
int8 calibrates on 4 batches other than the one measured (`other_batches`), so the error
includes what a range fitted to other data costs. bf16x3 splits every linear layer and
convolution it can (forms taken unmeasured), so its error is the split's wherever the CPU
has bf16 products, not float32's where float32 measured faster.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_leaves

from ..models import BenchmarkModel
from ..models import build as build_model


@dataclass
class Error:
    model: str
    mode: str           # "eager fp32", "opweave fp32", "opweave bf16", ...
    max_abs: float
    rel_l2: float
    scale: float        # max |reference|
    cosine: float = 1.0  # with eager float32's outputs


def _widen(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.float64)
    return x


def _outputs(result) -> list[torch.Tensor]:
    return [t.detach().to(torch.float64) for t in tree_leaves(result)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def error(got, reference) -> tuple[float, float]:
    """(max |got - reference|, ||got - reference|| / ||reference||) over all outputs."""
    got, reference = _outputs(got), _outputs(reference)
    if len(got) != len(reference):
        raise ValueError(f"{len(got)} floating outputs where the reference has {len(reference)}")
    diff = torch.cat([(g - r).flatten() for g, r in zip(got, reference)])
    ref = torch.cat([r.flatten() for r in reference])
    return float(diff.abs().max()), float(diff.norm() / ref.norm())


def cosine(got, reference) -> float:
    """The cosine similarity of all outputs together."""
    got = torch.cat([g.flatten() for g in _outputs(got)])
    reference = torch.cat([r.flatten() for r in _outputs(reference)])
    return float(torch.nn.functional.cosine_similarity(got, reference, dim=0))


def other_batches(bench: BenchmarkModel, count: int = 4) -> list[tuple]:
    """Batches like the benchmark's: each dense floating input drawn anew with its mean and
    standard deviation (fixed seeds); integer and sparse inputs (token ids, masks, a
    graph's adjacency) as they are."""
    generator = torch.Generator().manual_seed(7)

    def like(x):
        dense_float = isinstance(x, torch.Tensor) and x.is_floating_point() \
            and x.layout == torch.strided
        if not dense_float:
            return x
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return noise * x.std() + x.mean() if x.numel() > 1 else x.clone()
    return [tuple(like(x) for x in bench.inputs) for _ in range(count)]


def measure(bench: BenchmarkModel, precisions=("fp32", "bf16", "bf16x3", "int8")) -> list[Error]:
    """The errors of eager float32 and of opweave in each precision against float64."""
    from ..frontends.torch_export import compile as opweave_compile
    from ..options import Options

    module = bench.module.eval()
    with torch.no_grad():
        reference = copy.deepcopy(module).to(torch.float64)(*[_widen(x) for x in bench.inputs])
        scale = max(float(r.abs().max()) for r in _outputs(reference))
        runs = {"eager fp32": module(*bench.inputs)}
        for p in precisions:
            calibration = other_batches(bench) if p == "int8" else None
            options = Options.resolve(precision=p)
            if p == "bf16x3":
                options = replace(options, measure=False)
            compiled = opweave_compile(module, bench.inputs, name=bench.name, options=options,
                                       calibration=calibration)
            runs[f"opweave {p}"] = compiled(*bench.inputs)
    fp32 = runs["eager fp32"]
    return [Error(bench.name, mode, *error(got, reference), scale, cosine(got, fp32))
            for mode, got in runs.items()]


def measure_models(names, small: bool = False) -> list[Error]:
    return [e for name in names for e in measure(build_model(name, small=small))]


def table(errors: list[Error]) -> str:
    header = (f"{'model':<12} {'mode':<14} {'max abs':>9} {'rel L2':>9} {'max |ref|':>9} "
              f"{'cos(fp32)':>9}")
    rows = [f"{e.model:<12} {e.mode:<14} {e.max_abs:>9.2e} {e.rel_l2:>9.2e} {e.scale:>9.3g} "
            f"{e.cosine:>9.6f}" for e in errors]
    return "\n".join([header, "-" * len(header), *rows])
