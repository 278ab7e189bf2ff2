"""opweave: an optimizing compiler for deep-learning computation graphs.

Public API:
    opweave.compile(model, example_inputs)  -> a callable (captured with torch.export)
    opweave.explain(model, example_inputs)  -> coverage and IR report
    opweave.from_onnx("model.onnx")         -> a callable (ONNX frontend)
    opweave.to_onnx(graph, "out.onnx")      -> the IR graph written back as ONNX
    opweave.profile(compiled, inputs)       -> where the time goes (table, trace, HTML)
    opweave.horizontal([m1, ..., mN])       -> N instances of one model fused into one (HFTA)
    opweave.calibrating()                   -> calls inside calibrate int8 models
    torch.compile(model, backend="opweave") works without importing opweave.
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import openmp_waits as _openmp_waits

_openmp_waits.before_torch()  # before anything imports torch: libgomp reads its settings then


def compile(model, example_inputs, *, name=None, rewrite=None, fusion=None, train=False,
            loss_every=1, example_kwargs=None, options=None, memory_budget=None,
            precision=None, dynamic_shapes=None, device=None, schedule=None, calibration=None):
    """Compile `model` for inference on calls like `model(*example_inputs,
    **example_kwargs)`, or, with
    `train=True`, compile a training step: `model(*inputs)` returns a scalar loss, and
    calling the result runs forward and backward as one graph; `loss.backward()` then
    delivers the gradients. `loss_every`: compute the loss value on every N-th call only
    (1, the default: every call; None: never); other calls return NaN as the loss, and
    skip the work only the loss needed (loss elimination).
    `memory_budget`: the step's peak memory, in bytes (an int) or as a fraction of the
    unconstrained peak (a float in (0, 1]); activations are recomputed to meet it
    (Checkmate); a budget no schedule meets raises MemoryBudgetError with the smallest
    one found. `explain` and the "remat" report say the peak achieved.
    `precision`: None (as in `options`), "fp32", "bf16": matrix products, convolutions
    and attention on bfloat16 operands with float32 accumulation, everything else in
    float32, "bf16x3": linear layers and convolutions computed from three bf16 parts at
    float32's accuracy where that measures faster (AMX), or "int8": linear layers and
    convolutions in int8 (post-training static
    quantization, everything else float32; inference only; see docs/precision.md).
    `calibration`: with "int8", the batches (each a tuple of positional arguments, a dict
    of keyword arguments, or a tensor) whose activation ranges fix the int8 scales; by
    default the example inputs.
    `dynamic_shapes`: torch.export's `dynamic_shapes` (`{axis: torch.export.Dim(...)}`
    per input): those dims are captured as symbols and one compile serves every size in
    their ranges, with a plan built per size on first use (see docs/dynamic.md); a call
    outside them compiles a static program, with one warning. Inference only.
    `options`: an `opweave.Options` with every compiler option (default: read from the
    OPWEAVE_* environment variables; see `opweave.options`).
    `rewrite`: None (as in `options`), False, "eqsat", "greedy", "backtrack", "off", or
    `opweave.passes.rewrite.pipeline.RewriteOptions`.
    `fusion`: None (as in `options`), "ilp", "greedy", "off" or False.
    `device`: None (where the example inputs and weights are; CUDA tensors run on Triton
    kernels and torch's CUDA libraries, docs/gpu.md), "cpu", "cuda", or "auto" (each part
    of the graph placed on the CPU or the GPU by measurement, schedule/placement.py).
    `schedule`: None (as in `options`), "sequential" (the default: one step after another,
    each on every thread), "ios" or "critical-path": independent steps run at once on
    shares of the cores, in stages scheduled on measured costs and kept only where
    measured faster (docs/scheduling.md).

    The compiled model computes what `model` computes on the same call. Calls bind to
    `forward`'s signature (keywords as in Python). Tensors keep the example's shapes and
    dtypes; a call with other Python values (`k=5.0` where the example had 2.0) or another
    argument structure compiles a program of its own. Weights are read as they are when
    compiled: after an in-place update (optimizer step, `load_state_dict`) the next call
    recompiles, with one WeightsChangedWarning; a write through `p.data` is seen only when
    it changes the tensor's middle element, so call `compiled.refresh()` after partial ones. A model that writes to its buffers (BatchNorm in
    training mode: call `.eval()` first) runs in eager PyTorch, with a warning."""
    from .frontends.torch_export import compile as _compile

    return _compile(model, example_inputs, name=name, rewrite=rewrite, fusion=fusion,
                    train=train, loss_every=loss_every, example_kwargs=example_kwargs,
                    options=options, memory_budget=memory_budget, precision=precision,
                    dynamic_shapes=dynamic_shapes, device=device, schedule=schedule,
                    calibration=calibration)


def explain(model, example_inputs, *, name=None, graph_breaks=True, rewrite=None, train=False,
            memory_budget=None, precision=None, dynamic_shapes=None, device=None,
            schedule=None):
    """Report what opweave makes of `model`: ops, coverage, fallbacks, graph breaks, and
    the rewrite pass's rules fired and estimated cost before and after; with `train=True`
    the training step (`model` returns the loss), with each graph's peak memory and what
    was recomputed to meet `memory_budget`; with `precision="bf16"`, how many steps run in
    bf16 and on which of the CPU's units; with `dynamic_shapes`, each symbolic segment's
    plans and its peak memory as a formula over the size symbols; with `device="auto"`,
    where each group of operators runs and why; with `schedule="ios"`, the stages: which
    steps ran together, on how many threads, estimated against measured."""
    from .explanation import explain as _explain

    return _explain(model, example_inputs, name=name, graph_breaks=graph_breaks, rewrite=rewrite,
                    train=train, memory_budget=memory_budget, precision=precision,
                    dynamic_shapes=dynamic_shapes, device=device, schedule=schedule)


def from_onnx(source, *, name=None, rewrite=None, fusion=None, options=None, precision=None,
              schedule=None, calibration=None):
    """Load an ONNX model (path, bytes or ModelProto) as a callable over numpy/torch arrays;
    `precision` and `schedule` as in `compile`. `calibration`: with precision "int8", the
    batches (each a list of arrays in input order, or a dict by input name) whose
    activation ranges fix the int8 scales; without them, the first call at each shape
    calibrates."""
    from .onnx import from_onnx as _from_onnx

    return _from_onnx(source, name=name, rewrite=rewrite, fusion=fusion, options=options,
                      precision=precision, schedule=schedule, calibration=calibration)


def profile(compiled, inputs, *, runs=10, warmup=2, name=None):
    """Where the time of `compiled` (from `compile` or `from_onnx`) goes on `inputs`: per
    kernel, IR node, ATen/ONNX node, source line and module, each level adding up to the
    measured call; `.table()`, `.write_trace(path)`, `.write_html(path)`. See
    `opweave.profiling`."""
    from .profiling import profile as _profile

    return _profile(compiled, inputs, runs=runs, warmup=warmup, name=name)


def horizontal(models, shared=None):
    """HFTA: `models` (one architecture, each with its own weights) fused into one module
    whose weights are theirs stacked; call it with inputs stacked per instance, compile it
    like any module. `opweave.schedule.StackedSGD/StackedAdam` step every instance at once,
    each with its own hyper-parameters. See `opweave.schedule.horizontal`."""
    from .schedule import horizontal as _horizontal

    return _horizontal(models, shared)


def to_onnx(graph, path=None):
    """Write an IR graph (or a compiled model's single graph) as a checked ONNX model;
    returns the ModelProto, and saves it atomically when `path` is given."""
    from .onnx.export import export

    return export(graph, path)


def calibrating():
    """A context manager: calls of int8 models made inside it calibrate them (every call's
    activation ranges count), and leaving it fixes their scales. For models compiled
    without calibration batches, such as `torch.compile(m, backend="opweave",
    options={"precision": "int8"})`, which otherwise calibrate on their first call:

        with opweave.calibrating():
            for batch in batches:
                compiled(batch)
    """
    from .codegen.int8 import calibrating as _calibrating

    return _calibrating()


def backend(gm, example_inputs, **options):
    """The torch.compile backend (also registered as the `opweave` entry point)."""
    from .frontends.torch_dynamo import opweave_backend

    return opweave_backend(gm, example_inputs, **options)


def __getattr__(name):
    if name == "Options":  # imported on first use: it loads the rewrite engine
        from .options import Options

        return Options
    if name == "MemoryBudgetError":
        from .schedule.remat import MemoryBudgetError

        return MemoryBudgetError
    raise AttributeError(f"module 'opweave' has no attribute {name!r}")


__all__ = ["compile", "explain", "backend", "from_onnx", "to_onnx", "Options", "MemoryBudgetError",
           "__version__"]
