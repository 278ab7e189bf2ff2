"""The backends `opweave bench` compares, each prepared inside its own worker process.

A backend turns a benchmark model into a `Prepared`: one callable that runs one timed call
(an inference, or a whole training step), plus the outputs of its first call for the
accuracy check against eager. A backend that cannot run a model raises `Unavailable` with
the reason, which the report shows.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..codegen.precision import tally
from ..models import BenchmarkModel
from ..models.base import disable_dropout
from .modes import INFER, TRAIN

TRAINING_LR = 1e-3


class Unavailable(Exception):
    """This backend cannot run this model (in this mode); the message says why."""


@dataclass
class Prepared:
    step: Callable[[], object]
    first_outputs: list[np.ndarray]  # inference outputs; in training, loss then gradients
    setup_s: float  # capture + compile (+ the first call for JIT compilers)
    note: str = ""
    torch_memory: bool = True  # whether torch's allocator sees its working memory
    keep: list = field(default_factory=list)  # objects that must outlive the step


def _numpy(values) -> list[np.ndarray]:
    flat = torch.utils._pytree.tree_flatten(values)[0]
    return [v.detach().float().numpy().copy() if isinstance(v, torch.Tensor) else np.asarray(v)
            for v in flat]


def _timed_first_call(build: Callable[[], Callable[[], object]]) -> tuple[Callable, object, float]:
    """Build the step and make its first call; setup time covers both (JIT compilers
    compile on the first call)."""
    start = time.perf_counter()
    step = build()
    first = step()
    return step, first, time.perf_counter() - start


# -- inference -------------------------------------------------------------------------------

def _infer_torch(bench: BenchmarkModel, compile_fn: Callable[[torch.nn.Module], Callable]) -> Prepared:
    module = bench.module.eval()

    def build():
        compiled = compile_fn(module)

        def step():
            with torch.no_grad():
                return compiled(*bench.inputs)
        return step

    step, first, setup_s = _timed_first_call(build)
    return Prepared(step, _numpy(first), setup_s)


def _infer_eager(bench, threads):
    return _infer_torch(bench, lambda m: m)


def _infer_inductor(bench, threads, freezing=False, autocast=None):
    """torch.compile's default backend; `autocast`: a dtype to run each call under
    `torch.autocast("cpu", dtype=...)` (Inductor's documented bf16 path on CPUs, with
    freezing; its outputs are widened for the check)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = freezing
    torch._dynamo.reset()
    if autocast is None:
        return _infer_torch(bench, lambda m: torch.compile(m))

    def compile_(m):
        compiled = torch.compile(m)

        def call(*args):
            with torch.autocast("cpu", dtype=autocast):
                return compiled(*args)
        return call
    prepared = _infer_torch(bench, compile_)
    prepared.note = f"freezing={freezing}, autocast {autocast}"
    return prepared


def _infer_inductor_freezing(bench, threads):
    return _infer_inductor(bench, threads, freezing=True)


def _infer_inductor_bf16(bench, threads):
    return _infer_inductor(bench, threads, freezing=True, autocast=torch.bfloat16)


def _program_notes(programs) -> list[str]:
    """What the rewrite pass and fusion did, summed over the compiled programs (one for
    `opweave.compile`, one per graph for torch.compile)."""
    rewrites = [r for p in programs for r in p.rewrites if r.engine != "off"]
    lowered = [low for p in programs for step in p.steps
               for low in [getattr(getattr(step, "executor", None), "lowered", None)]
               if low is not None]
    notes = []
    if rewrites:
        before, after = (sum(getattr(r, k) for r in rewrites) for k in ("cost_before", "cost_after"))
        notes.append(f"rewrite {before * 1e3:.1f} -> {after * 1e3:.1f} ms est. in "
                     f"{sum(r.seconds for r in rewrites):.1f} s")
    for method in dict.fromkeys(low.partition.method for low in lowered):
        counts = [low.kernel_counts() for low in lowered if low.partition.method == method]
        library, cpp, op = (sum(c.get(k, 0) for c in counts) for k in ("library", "cpp", "op"))
        rescheduled = sum(low.rescheduled for low in lowered if low.partition.method == method)
        notes.append(f"{method} fusion: {library} library + {cpp} generated kernels"
                     + (f" ({rescheduled} on tuned schedules)" if rescheduled else "")
                     + f", {op} single ops")
    steps = [s for low in lowered for s in low.steps]
    in_bf16, eligible = tally(steps, "bf16")
    if in_bf16:
        notes.append(f"{in_bf16} of {eligible} product/convolution/attention steps in bf16")
    split, eligible = tally(steps, "bf16x3")
    if split:
        notes.append(f"{split} of {eligible} linear/convolution steps from bf16 parts (bf16x3)")
    in_int8, eligible = tally(steps, "int8")
    if in_int8:
        notes.append(f"{in_int8} of {eligible} linear/convolution steps in int8")
    in_int8, eligible = tally(steps, "int8-dynamic")
    if in_int8:
        notes.append(f"{in_int8} of {eligible} linear steps in int8 (dynamic)")
    return notes


def _with_fallback_notes(prepare: Callable[[], Prepared]) -> tuple[Prepared, list[str]]:
    """Run `prepare`, collecting opweave's fallback warnings (first lines) as notes."""
    import warnings

    from ..frontends.program import OpweaveFallbackWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OpweaveFallbackWarning)
        prepared = prepare()
    return prepared, [str(w.message).splitlines()[0] for w in caught
                      if issubclass(w.category, OpweaveFallbackWarning)]


def _infer_opweave(bench, threads, rewrite=None, fusion=None, native=None, tuned=False,
                   precision="fp32"):
    """opweave.compile; untuned (the configuration `opweave tune` recorded is not used)
    unless `tuned`, so `opweave` vs `opweave-tuned` is what tuning gained."""
    from dataclasses import replace

    from ..frontends.torch_export import compile as opweave_compile
    from ..options import Options

    compiled = []
    options = replace(Options.resolve(), tuned=tuned, precision=precision)
    if native is not None:
        options = replace(options, native=native)

    def compile_(m):
        calibration = calibration_batches(bench) if precision == "int8" else None
        compiled.append(opweave_compile(m, bench.inputs, name=bench.name, rewrite=rewrite,
                                        fusion=fusion, options=options,
                                        calibration=calibration))
        return compiled[-1]

    prepared, notes = _with_fallback_notes(lambda: _infer_torch(bench, compile_))
    if tuned:
        program = compiled[-1].program if compiled else None
        used = [r.detail for g in (program.compiled_graphs if program else []) for r in g.reports
                if r.name == "tuned"]
        if not used:
            raise Unavailable(f"no configuration tuned for {bench.name} with {threads} thread(s) "
                              f"on this machine in the tuning database: run `opweave tune "
                              f"{bench.name} --threads {threads}` first")
        notes.append("tuned: " + "; ".join(dict.fromkeys(d.split(" from ")[0] for d in used)))
    notes += _program_notes([compiled[-1].program] if compiled else [])
    prepared.note = "; ".join(notes)
    return prepared


def _infer_opweave_bf16(bench, threads):
    return _infer_opweave(bench, threads, precision="bf16")


def _infer_opweave_bf16x3(bench, threads):
    return _infer_opweave(bench, threads, precision="bf16x3")


def _infer_opweave_int8(bench, threads):
    return _infer_opweave(bench, threads, precision="int8")


def _infer_opweave_dynamic_int8(bench, threads):
    return _infer_opweave(bench, threads, precision="int8-dynamic")


def _infer_opweave_tuned(bench, threads):
    return _infer_opweave(bench, threads, tuned=True)


def _infer_opweave_dynamo(bench, threads, precision="fp32"):
    """`torch.compile(module.eval(), backend="opweave")` called under `torch.no_grad()`:
    AOTAutograd's inference graphs, weights frozen by the backend. The comparison with
    `opweave` is what the torch.compile path costs (graph breaks, guards, AOTAutograd)."""
    from ..frontends import torch_dynamo

    torch._dynamo.reset()
    graphs_mark = torch_dynamo.compiled_graphs.mark()
    frozen_mark = torch_dynamo.frozen_programs.mark()
    options = {"precision": precision}
    prepared, notes = _with_fallback_notes(lambda: _infer_torch(
        bench, lambda m: torch.compile(m, backend="opweave", options=options)))
    programs = torch_dynamo.compiled_graphs.since(graphs_mark)
    prepared.step()  # a second call: a guard that fails on it recompiles here, not in timing
    recompiled = len(torch_dynamo.compiled_graphs.since(graphs_mark)) - len(programs)
    count = len(programs)
    frozen = len(torch_dynamo.frozen_programs.since(frozen_mark))
    notes.insert(0, f"{count} graph{'s' * (count != 1)}"
                    f"{' (graph breaks)' if count > 1 else ''}, {frozen} with frozen weights")
    if recompiled:
        notes.append(f"recompiled {recompiled} graph(s) on the second call")
    prepared.note = "; ".join(notes + _program_notes(programs))
    return prepared


def _infer_opweave_dynamo_bf16(bench, threads):
    return _infer_opweave_dynamo(bench, threads, precision="bf16")


def _infer_opweave_dynamo_int8(bench, threads):
    """torch.compile's graphs calibrate on their first call: the benchmark's inputs, as
    for the other int8 backends."""
    return _infer_opweave_dynamo(bench, threads, precision="int8")


def _infer_opweave_norewrite(bench, threads):
    return _infer_opweave(bench, threads, rewrite=False)


def _infer_opweave_nofusion(bench, threads):
    return _infer_opweave(bench, threads, fusion="off")


def _infer_opweave_greedy(bench, threads):
    return _infer_opweave(bench, threads, fusion="greedy")


def _infer_opweave_python(bench, threads):
    return _infer_opweave(bench, threads, native="off")


def _export_form(bench: BenchmarkModel) -> tuple[torch.nn.Module, str]:
    if bench.export_module is not None:
        return bench.export_module.eval(), bench.export_note
    return bench.module.eval(), ""


def export_onnx(module: torch.nn.Module, inputs, path: str) -> None:
    """`torch.onnx.export` (the torch.export-based exporter, with its own graph cleanup)."""
    with torch.no_grad():
        program = torch.onnx.export(module, inputs, dynamo=True, optimize=True, verbose=False)
    program.save(path)


def _infer_onnxruntime(bench, threads, int8=False):
    """ONNX Runtime on the exported model; `int8`: quantized by its post-training static
    quantizer (QDQ format, per-channel int8 weights, uint8 activations, calibrated on the
    same batches opweave-int8 calibrates on: `calibration_batches`)."""
    try:
        import onnxruntime as ort
    except ImportError as error:
        raise Unavailable(f"onnxruntime is not installed ({error})") from None
    module, note = _export_form(bench)
    start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="opweave-bench-")
    path = os.path.join(tmp.name, f"{bench.name}.onnx")
    try:
        export_onnx(module, bench.inputs, path)
    except Exception as error:  # the exporter's own message is the reason
        raise Unavailable(f"torch.onnx.export failed: {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:200]}") from None
    fused = _ort_transformer_fusions(bench, path)
    if fused:
        note = "; ".join(filter(None, [note, fused]))
    if int8:
        _ort_quantize(bench, path)
        note = "; ".join(filter(None, [note, "quantize_static: QDQ, per-channel"]))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning stays on (ONNX Runtime's default and fastest); the worker waits for the
    # spinning to stop before it answers, so it never runs on another backend's time.
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    tmp.cleanup()  # the session holds the model; do not leave hundreds of MB in /tmp
    feed = _ort_feed(session, bench.inputs)

    def step():
        return session.run(None, feed)

    first = step()
    setup_s = time.perf_counter() - start
    return Prepared(step, [np.asarray(o, dtype=np.float32) for o in first], setup_s,
                    note=note, torch_memory=False)


def _ort_quantize(bench: BenchmarkModel, path: str) -> None:
    """Rewrite `path` in place as ONNX Runtime's statically quantized model."""
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
    if len(names) != len(bench.inputs):  # as `_ort_feed` says it: no silent shift of names
        raise Unavailable(f"the exported model takes {len(names)} inputs ({', '.join(names)}), "
                          f"the module {len(bench.inputs)}")

    class Batches(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{n: x.numpy() for n, x in zip(names, batch)}
                               for batch in calibration_batches(bench)])

        def get_next(self):
            return next(self.feeds, None)

    quantized = path + ".int8.onnx"
    quantize_static(path, quantized, Batches(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    os.replace(quantized, path)


def calibration_batches(bench: BenchmarkModel) -> list[tuple[torch.Tensor, ...]]:
    """What every int8 backend calibrates on: the benchmark's own inputs (the accuracy
    report, `bench/accuracy.py`, calibrates on other batches)."""
    return [tuple(bench.inputs)]


def _infer_onnxruntime_int8(bench, threads):
    return _infer_onnxruntime(bench, threads, int8=True)


def _ort_feed(session, inputs) -> dict:
    """Inputs by the session's names, in the module's order; a count mismatch (an input
    the exporter dropped) is an error, not a silent shift."""
    names = [arg.name for arg in session.get_inputs()]
    if len(names) != len(inputs):
        raise Unavailable(f"the exported model takes {len(names)} inputs ({', '.join(names)}), "
                          f"the module {len(inputs)}")
    for arg, x in zip(session.get_inputs(), inputs):
        shape = [d if isinstance(d, int) else None for d in arg.shape]
        if len(shape) != x.dim() or any(d is not None and d != s for d, s in zip(shape, x.shape)):
            raise Unavailable(f"exported input {arg.name!r} has shape {arg.shape}, "
                              f"the module's is {list(x.shape)}")
    return {name: x.numpy() for name, x in zip(names, inputs)}


# ONNX Runtime's documented best path for transformer models: its transformers optimizer
# (attention, skip-layer-norm and bias-GELU fusions) before the session's own optimizations.
ORT_TRANSFORMER_TYPES = {"bert": "bert", "vit": "vit"}


def _ort_transformer_fusions(bench: BenchmarkModel, path: str) -> str:
    """Rewrite `path` in place with ONNX Runtime's transformer fusions when the model is a
    transformer it knows; returns a note with the fused operators ("" if none applied)."""
    model_type = next((t for prefix, t in ORT_TRANSFORMER_TYPES.items()
                       if bench.name.startswith(prefix)), None)
    config = getattr(bench.module, "config", None)
    if model_type is None or config is None:
        return ""
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(path, model_type=model_type, num_heads=config.num_attention_heads,
                               hidden_size=config.hidden_size)
    stats = {op: n for op, n in optimized.get_fused_operator_statistics().items() if n}
    optimized.save_model_to_file(path)
    fused = ", ".join(f"{op} x{n}" for op, n in sorted(stats.items()))
    return f"transformers optimizer ({model_type}): {fused or 'no fusions'}"


# OpenVINO's CPU plugin runs fp32 models in bf16 where the CPU has bf16 units (AVX512-BF16,
# AMX) unless told otherwise: `openvino` asks for f32 (the comparison the others make),
# `openvino-default` leaves the precision to OpenVINO and says which it chose.
def _infer_openvino(bench, threads, precision: str | None = "f32"):
    try:
        import openvino as ov
    except ImportError as error:
        raise Unavailable(f"OpenVINO is not installed ({error})") from None
    module, note = _export_form(bench)
    start = time.perf_counter()
    try:  # TorchScript tracing of the module, OpenVINO's default PyTorch path
        with torch.no_grad():
            model = ov.convert_model(module, example_input=tuple(bench.inputs))
    except Exception as error:
        raise Unavailable(f"openvino.convert_model failed: {type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:200]}") from None
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    try:
        compiled = ov.Core().compile_model(model, "CPU", config)
    except Exception as error:
        raise Unavailable(f"OpenVINO could not compile it: {type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:200]}") from None
    if len(compiled.inputs) != len(bench.inputs):
        raise Unavailable(f"the converted model takes {len(compiled.inputs)} inputs, "
                          f"the module {len(bench.inputs)}")
    request = compiled.create_infer_request()
    feed = [x.numpy() for x in bench.inputs]

    def step():
        return request.infer(feed, share_inputs=True, share_outputs=True)

    first = [np.array(out, dtype=np.float32) for out in step().values()]
    setup_s = time.perf_counter() - start
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")  # an openvino.Type
    chosen = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    label = (f"inference precision {chosen}" if precision is not None
             else f"OpenVINO's default precision: {chosen}")
    note = "; ".join(filter(None, [note, label]))
    return Prepared(step, first, setup_s, note=note, torch_memory=False,
                    keep=[compiled, request, feed])


def _infer_openvino_bf16(bench, threads):
    return _infer_openvino(bench, threads, precision="bf16")


def _infer_openvino_default(bench, threads):
    return _infer_openvino(bench, threads, precision=None)


def tvm_target(threads: int):
    import tvm
    from tvm.target import codegen

    return tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu",
                              "mcpu": codegen.llvm_get_system_cpu(), "num-cores": threads})


def _infer_tvm(bench, threads):
    try:
        import tvm
        from tvm import relax
        from tvm.relax.frontend.torch import from_exported_program
    except ImportError as error:
        raise Unavailable(f"Apache TVM is not installed ({error})") from None
    module, note = _export_form(bench)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            exported = torch.export.export(module, bench.inputs)
        ir_module = from_exported_program(exported, keep_params_as_input=False)
        executable = tvm.compile(ir_module, target=tvm_target(threads))
    except Exception as error:
        raise Unavailable(f"TVM could not import or compile it: {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:200]}") from None
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(x.numpy()) for x in bench.inputs]
    main = vm["main"]

    def step():
        return main(*args)

    def to_numpy(out):
        if hasattr(out, "numpy"):
            return [out.numpy()]
        return [o for item in out for o in to_numpy(item)]

    first = to_numpy(step())
    setup_s = time.perf_counter() - start
    note = "; ".join(filter(None, [note, "default schedules (untuned)"]))
    return Prepared(step, first, setup_s, note=note, torch_memory=False, keep=[vm, args])


# -- training step ---------------------------------------------------------------------------

def _train(bench: BenchmarkModel, compile_fn: Callable[[torch.nn.Module], Callable]) -> Prepared:
    """Forward, loss, backward and an SGD step; the first step's loss and gradients (taken
    before the update) are the accuracy outputs."""
    loss_module = disable_dropout(bench.loss_module.train())
    params = [p for p in loss_module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=TRAINING_LR)
    start = time.perf_counter()  # setup covers compiling and the first step
    compiled = compile_fn(loss_module)

    def forward_backward():
        loss = compiled(*bench.inputs, bench.targets)
        loss.backward()
        return loss

    def update():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step():
        loss = forward_backward()
        update()
        return loss

    loss = forward_backward()
    setup_s = time.perf_counter() - start
    first = _numpy([loss] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    update()
    return Prepared(step, first, setup_s)


def _train_eager(bench, threads):
    return _train(bench, lambda m: m)


def _train_inductor(bench, threads):
    import torch._inductor.config as inductor_config

    inductor_config.freezing = False
    torch._dynamo.reset()
    return _train(bench, lambda m: torch.compile(m))


def _train_opweave(bench, threads, loss_every=1):
    """The joint forward+backward graph through `opweave.compile(train=True)`."""
    from ..frontends.torch_export import compile as opweave_compile

    def compile_(module):
        return opweave_compile(module, (*bench.inputs, bench.targets), name=bench.name,
                               train=True, loss_every=loss_every)

    prepared = _train(bench, compile_)
    if loss_every != 1:
        prepared.note = f"loss computed on every {loss_every}th step only"
    return prepared


def _train_opweave_noloss(bench, threads):
    return _train_opweave(bench, threads, loss_every=1000)


def _train_opweave_dynamo(bench, threads):
    """torch.compile(backend="opweave"): AOTAutograd's separate forward and backward graphs."""
    torch._dynamo.reset()
    return _train(bench, lambda m: torch.compile(m, backend="opweave"))


def _inference_only(name):
    def prepare(bench, threads):
        raise Unavailable(f"{name} is an inference backend here; no training step")
    return prepare


PREPARE: dict[str, dict[str, Callable[..., Prepared]]] = {
    "eager": {INFER: _infer_eager, TRAIN: _train_eager},
    "inductor": {INFER: _infer_inductor, TRAIN: _train_inductor},
    "inductor-freezing": {INFER: _infer_inductor_freezing,
                          TRAIN: _inference_only("inductor with freezing (frozen weights)")},
    "onnxruntime": {INFER: _infer_onnxruntime, TRAIN: _inference_only("ONNX Runtime")},
    "tvm": {INFER: _infer_tvm, TRAIN: _inference_only("TVM")},
    "openvino": {INFER: _infer_openvino, TRAIN: _inference_only("OpenVINO")},
    # bf16 by the user's choice (`opweave bench --precision bf16`), held to bf16's tolerance
    "openvino-bf16": {INFER: _infer_openvino_bf16, TRAIN: _inference_only("OpenVINO bf16")},
    "inductor-bf16": {INFER: _infer_inductor_bf16, TRAIN: _inference_only("Inductor bf16")},
    "opweave-bf16": {INFER: _infer_opweave_bf16, TRAIN: _inference_only("precision bf16")},
    "opweave-dynamo-bf16": {INFER: _infer_opweave_dynamo_bf16,
                            TRAIN: _inference_only("precision bf16")},
    # float32's accuracy from bf16 parts (`opweave bench --precision bf16x3`)
    "opweave-bf16x3": {INFER: _infer_opweave_bf16x3, TRAIN: _inference_only("precision bf16x3")},
    # int8 by the user's choice (`opweave bench --precision int8`), held to int8's tolerance
    "onnxruntime-int8": {INFER: _infer_onnxruntime_int8,
                         TRAIN: _inference_only("ONNX Runtime int8")},
    "opweave-int8": {INFER: _infer_opweave_int8, TRAIN: _inference_only("precision int8")},
    "opweave-dynamic-int8": {INFER: _infer_opweave_dynamic_int8,
                             TRAIN: _inference_only("precision int8-dynamic")},
    "opweave-dynamo-int8": {INFER: _infer_opweave_dynamo_int8,
                            TRAIN: _inference_only("precision int8")},
    # labelled apart: bf16 where the CPU has it, so not an fp32 figure there
    "openvino-default": {INFER: _infer_openvino_default,
                         TRAIN: _inference_only("OpenVINO (default precision)")},
    "opweave": {INFER: _infer_opweave, TRAIN: _train_opweave},
    # with the configuration `opweave tune MODEL` recorded (Unavailable without one)
    "opweave-tuned": {INFER: _infer_opweave_tuned, TRAIN: _inference_only("tuning")},
    # training: loss elimination
    "opweave-noloss": {INFER: _inference_only("the loss-elimination comparison"),
                       TRAIN: _train_opweave_noloss},
    # the torch.compile path: frozen inference graphs, AOTAutograd's split training graphs
    "opweave-dynamo": {INFER: _infer_opweave_dynamo, TRAIN: _train_opweave_dynamo},
    # the rewrite pass's contribution: opweave with it turned off
    "opweave-norewrite": {INFER: _infer_opweave_norewrite,
                          TRAIN: _inference_only("the rewrite comparison")},
    # fusion's contribution: op by op, and the greedy partitioner instead of the ILP
    "opweave-nofusion": {INFER: _infer_opweave_nofusion,
                         TRAIN: _inference_only("the fusion comparison")},
    "opweave-greedy": {INFER: _infer_opweave_greedy,
                       TRAIN: _inference_only("the fusion comparison")},
    # the native plan's contribution: every call through the Python steps
    "opweave-python": {INFER: _infer_opweave_python,
                       TRAIN: _inference_only("the native-plan comparison")},
}
BACKENDS = tuple(PREPARE)


def prepare(backend: str, bench: BenchmarkModel, mode: str, threads: int) -> Prepared:
    try:
        by_mode = PREPARE[backend]
    except KeyError:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}") from None
    if backend.startswith("opweave"):
        _native_ready()
    return by_mode[mode](bench, threads)


def _native_ready() -> None:
    """Build the native runtime before anything is timed (by default it builds in the
    background, and calls run from Python until it is ready)."""
    from ..options import Options
    from ..runtime import native

    if Options.from_env().native != "off":
        native.module(wait=True)
