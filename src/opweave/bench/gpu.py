"""`opweave bench --device cuda`: the benchmark models on one GPU, in one process.

Backends: eager, Inductor (default; with CUDA graphs, mode="reduce-overhead"; and
max-autotune when asked), ONNX Runtime's CUDA
provider where it is installed, opweave (`opweave.compile` on CUDA tensors) and
opweave through `torch.compile(backend="opweave")`. Inference at the model's batch (1),
or a training step (forward and backward of the model's loss). fp32 with TF32 allowed in
matrix products and convolutions for every backend (what Inductor and cuBLAS default to
for speed; the report says so), or bf16: autocast for eager and Inductor,
`precision="bf16"` for opweave.

Timing: each sample is the mean of `calls` calls between two CUDA events; backends are
interleaved round by round and the median sample is reported. Every backend's output is
compared with eager's (largest difference relative to eager's largest magnitude).
"""
from __future__ import annotations

import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree

INFER_BACKENDS = ("eager", "inductor", "inductor-cudagraphs", "ort-cuda", "opweave",
                  "opweave-dynamo")
TRAIN_BACKENDS = ("eager", "inductor", "opweave")


@dataclass
class Entry:
    backend: str
    ms: float | None = None
    samples: list[float] = field(default_factory=list)
    compile_s: float | None = None
    error: float | None = None     # max |out - eager| / max |eager|
    note: str = ""


@dataclass
class ModelResult:
    model: str
    entries: list[Entry]


def _tensors(out) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _difference(got, want) -> float:
    worst = 0.0
    for a, b in zip(_tensors(got), _tensors(want)):
        scale = b.float().abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return worst


def _on_cuda(bench):
    module = bench.module.eval().cuda()
    inputs = tuple(t.cuda() for t in bench.inputs)
    return module, inputs


def _infer_callables(name: str, bench, backend: str, precision: str):
    import opweave

    module, inputs = _on_cuda(bench)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" \
        else (lambda: torch.autocast("cuda", enabled=False))

    def wrap(fn):
        def call():
            with torch.no_grad(), autocast():
                return fn(*inputs)
        return call

    if backend == "eager":
        return wrap(module)
    if backend == "inductor":
        return wrap(torch.compile(module))
    if backend == "inductor-cudagraphs":
        return wrap(torch.compile(module, mode="reduce-overhead"))
    if backend == "inductor-max-autotune":
        return wrap(torch.compile(module, mode="max-autotune"))
    if backend == "opweave":
        compiled = opweave.compile(module, inputs, name=name,
                                   precision="bf16" if precision == "bf16" else None)
        return lambda: _no_grad(compiled, inputs)
    if backend == "opweave-dynamo":
        _register_backend()
        options = {"precision": "bf16"} if precision == "bf16" else {}
        fn = torch.compile(module, backend="opweave", options=options)
        return lambda: _no_grad(fn, inputs)
    if backend == "ort-cuda":
        return _ort_cuda(module, inputs)
    raise ValueError(f"unknown GPU backend {backend!r}")


def _register_backend() -> None:
    """The entry point registers "opweave" when the package is installed; a checkout run
    from its source tree (PYTHONPATH=src) registers it here."""
    from torch._dynamo import list_backends, register_backend

    if "opweave" not in list_backends(exclude_tags=()):
        from ..frontends.torch_dynamo import opweave_backend
        register_backend(name="opweave")(opweave_backend)


def _no_grad(fn, inputs):
    with torch.no_grad():
        return fn(*inputs)


def _ort_cuda(module, inputs):
    import io

    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError("onnxruntime here has no CUDAExecutionProvider")
    buffer = io.BytesIO()
    torch.onnx.export(module, inputs, buffer, dynamo=True)
    session = ort.InferenceSession(buffer.getvalue(), providers=["CUDAExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feed = {n: t.cpu().numpy() for n, t in zip(names, inputs)}
    return lambda: [torch.from_numpy(a) for a in session.run(None, feed)]


def _train_callables(name: str, bench, backend: str):
    import opweave
    from ..models.base import disable_dropout

    loss_module = disable_dropout(bench.loss_module).train().cuda()
    args = tuple(t.cuda() for t in (*bench.inputs, bench.targets))
    params = [p for p in loss_module.parameters() if p.requires_grad]

    def step(fn):
        def call():
            for p in params:
                p.grad = None
            loss = fn(*args)
            loss.backward()
            return loss.detach()
        return call

    if backend == "eager":
        return step(loss_module)
    if backend == "inductor":
        return step(torch.compile(loss_module))
    if backend == "opweave":
        return step(opweave.compile(loss_module, args, name=name, train=True))
    raise ValueError(f"{backend} has no training step here")


def _time(call, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def bench_model(name: str, backends, mode: str, precision: str, runs: int, calls: int,
                log=print) -> ModelResult:
    from .. import models

    bench = models.build(name)
    entries, prepared = [], {}
    reference = None
    for backend in backends:
        entry = Entry(backend)
        entries.append(entry)
        try:
            start = time.perf_counter()
            call = (_train_callables(name, bench, backend) if mode == "train"
                    else _infer_callables(name, bench, backend, precision))
            for _ in range(3):
                out = call()
            torch.cuda.synchronize()
            entry.compile_s = time.perf_counter() - start
            if backend == "eager":
                reference = out
            elif reference is not None:
                entry.error = _difference(out, reference)
            prepared[backend] = call
        except Exception as err:  # noqa: BLE001  (a backend's failure is a result)
            entry.note = f"{type(err).__name__}: {err}"[:300]
            log(f"{name} {backend}: failed\n{traceback.format_exc()}")
    for _ in range(runs):
        for entry in entries:
            if entry.backend in prepared:
                entry.samples.append(_time(prepared[entry.backend], calls))
    for entry in entries:
        if entry.samples:
            entry.ms = statistics.median(entry.samples)
    return ModelResult(name, entries)


def table(results: list[ModelResult], backends) -> str:
    head = "| model | " + " | ".join(backends) + " |"
    lines = [head, "|---|" + "---:|" * len(backends)]
    for r in results:
        by = {e.backend: e for e in r.entries}
        eager = by.get("eager")
        cells = []
        for b in backends:
            e = by.get(b)
            if e is None or e.ms is None:
                cells.append("failed" if e is not None else "")
                continue
            ratio = f" ({eager.ms / e.ms:.2f}x)" if eager and eager.ms and b != "eager" else ""
            cells.append(f"{e.ms:.3f}{ratio}")
        lines.append(f"| {r.model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(models_: list[str], backends, mode: str, precision: str, runs: int, calls: int,
        out: Path) -> list[ModelResult]:
    torch.backends.cuda.matmul.allow_tf32 = precision == "fp32"
    torch.backends.cudnn.allow_tf32 = precision == "fp32"
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    results = []
    for name in models_:
        results.append(bench_model(name, backends, mode, precision, runs, calls))
        (out / f"gpu-{mode}-{precision}.json").write_text(json.dumps(
            {"device": device, "torch": torch.__version__, "mode": mode, "precision": precision,
             "tf32": precision == "fp32", "results": [asdict(r) for r in results]}, indent=1))
        print(f"{name}: " + ", ".join(f"{e.backend} {e.ms:.3f} ms" if e.ms else f"{e.backend} failed"
                                      for e in results[-1].entries), flush=True)
    print(f"\n{device}, torch {torch.__version__}, {mode}, {precision}"
          f"{' (TF32 allowed)' if precision == 'fp32' else ''}; ms per call, median of {runs} "
          f"samples of {calls} calls (speed-up over eager)\n")
    print(table(results, backends))
    errors = {(r.model, e.backend): e.error for r in results for e in r.entries if e.error is not None}
    print("\nlargest difference from eager, relative to eager's largest magnitude:")
    for (m, b), err in errors.items():
        print(f"  {m} {b}: {err:.2e}")
    return results
