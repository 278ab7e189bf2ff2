"""One graph through each path, compared with eager.

First `rules`: eager computes the types the graph declares. Paths: `compile` (opweave.compile: torch.export, lowering, rewrite, fusion), `dynamo`
(torch.compile(backend="opweave"), fullgraph), `onnx` (the IR graph exported with
opweave.to_onnx, imported and run by opweave.from_onnx) and `train` (opweave.compile
with train=True on a weighted sum of the float outputs: loss and parameter gradients
against eager autograd; only for graphs with a gradient to check).

A path fails when it raises, when opweave warns that it fell back (an op run in eager,
a fusion or rewrite pass skipped), or when a result differs beyond `TOLERANCES`.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

from .. import notices
from ..ir import Graph
from . import oracle
from .to_module import GraphModule, LossModule, loss_weights, runtime_inputs

PATHS = ("compile", "dynamo", "onnx", "train")
# Checked first for every graph: each node's reference implementation computes the types
# its shape and dtype rules declare (the other paths trust the rules).
RULES = "rules"

# Per float dtype: (rtol, atol). A result may differ from eager by atol + rtol * |eager|
# plus NOISE times the largest difference between eager and its float64 shadow in that
# tensor: as far as eager itself is from exact, a backend may be too (sums and GEMMs
# reassociate, vector transcendental functions round differently). Integer and bool
# results must be equal, except where eager and its shadow disagree too (a float cast
# or comparison at a rounding boundary).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-9, 1e-9)}
NOISE = 8.0


@dataclass
class Outcome:
    path: str
    status: str          # "pass", "fail" or "skip"
    kind: str = ""       # failure class: "mismatch", "fallback", "error: TypeName", ...
    message: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "fail"


class PathSkipped(Exception):
    """The path does not apply to this graph (no gradient, no ONNX form)."""


class Fallback(Exception):
    """opweave gave up on part of the graph and ran it another way."""


# -- comparison ----------------------------------------------------------------------------
def compare(got, expected, shadow, what: str = "output",
            least_precise: torch.dtype | None = None) -> str:
    """'' when `got` matches, otherwise the first difference, described. A float result
    is held to the tolerance of its own dtype, or of `least_precise` (the least precise
    float type the graph computes in) when that is coarser: a float64 loss summed from
    float32 terms is only as exact as float32."""
    if len(got) != len(expected):
        return f"{len(got)} {what}s, expected {len(expected)}"
    for k, (g, e, s) in enumerate(zip(got, expected, shadow)):
        if not isinstance(g, torch.Tensor):
            return f"{what} {k} is a {type(g).__name__}, expected a tensor"
        if g.dtype != e.dtype or tuple(g.shape) != tuple(e.shape):
            return (f"{what} {k} is {g.dtype}{list(g.shape)}, "
                    f"expected {e.dtype}{list(e.shape)}")
        problem = _differs(g.detach(), e.detach(), s.detach(), least_precise)
        if problem:
            return f"{what} {k} ({e.dtype}{list(e.shape)}): {problem}"
    return ""


def _differs(got: torch.Tensor, expected: torch.Tensor, shadow: torch.Tensor,
             least_precise: torch.dtype | None = None) -> str:
    if not expected.numel():
        return ""
    if not expected.is_floating_point():
        bad = got != expected
        if not bad.any():
            return ""
        unstable = expected != shadow.to(expected.dtype)
        if (bad & ~unstable).any():
            i = _first(bad & ~unstable)
            return f"at {i}: got {got[i].item()}, expected {expected[i].item()}"
        return ""
    dtype = expected.dtype
    if least_precise is not None and torch.finfo(least_precise).eps > torch.finfo(dtype).eps:
        dtype = least_precise
    rtol, atol = TOLERANCES.get(dtype, (1e-2, 1e-2))
    e, g = expected.double(), got.double()
    # a non-finite shadow where eager is finite: as ill-conditioned as it gets
    noise = (e - shadow.double()).abs().nan_to_num(nan=float("inf")).max().item()
    allowed = atol + rtol * e.abs() + NOISE * noise
    err = (g - e).abs()
    bad = ~(err <= allowed)  # NaN in got counts as bad
    if not bad.any():
        return ""
    i = _first(bad)
    return (f"at {i}: got {g[i].item():.9g}, expected {e[i].item():.9g} "
            f"(max error {err.nan_to_num(float('inf')).max().item():.3g}, "
            f"eager-vs-float64 noise {noise:.3g})")


def _first(mask: torch.Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0]) if mask.dim() else ()


# -- the paths -----------------------------------------------------------------------------
def _as_list(result) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    return [torch.from_numpy(r) if hasattr(r, "__array__") and not isinstance(r, torch.Tensor)
            else r for r in result]


def run_compile(case: oracle.Case) -> list[torch.Tensor]:
    import opweave

    compiled = opweave.compile(GraphModule(case.graph), case.inputs, name="fuzz")
    if compiled.capture != "export":
        raise Fallback(f"captured with {compiled.capture}: {compiled.capture_error}")
    return _as_list(compiled(*case.inputs))


def run_dynamo(case: oracle.Case) -> list[torch.Tensor]:
    from ..frontends import torch_dynamo

    torch._dynamo.reset()
    before = torch_dynamo.compiled_graphs.mark()
    fn = torch.compile(GraphModule(case.graph), backend="opweave", fullgraph=True)
    try:
        result = _as_list(fn(*case.inputs))
        compiled = torch_dynamo.compiled_graphs.since(before)
    finally:
        torch._dynamo.reset()
    if not compiled:
        raise Fallback("Dynamo handed opweave no graph")
    return result


def run_onnx(case: oracle.Case) -> list[torch.Tensor]:
    import opweave
    from ..onnx import OnnxExportError, OnnxUnsupported

    try:
        model = opweave.to_onnx(case.graph)
    except OnnxExportError as err:
        raise PathSkipped(f"no ONNX form: {err}") from None
    try:
        return _as_list(opweave.from_onnx(model, name="fuzz")(*case.inputs))
    except OnnxUnsupported as err:  # the importer refuses what the exporter wrote
        raise PathSkipped(f"the importer refuses it: {err}") from None


def trainable_inputs(case: oracle.Case, seed: int) -> list[bool]:
    """Which graph inputs the train path makes parameters: the float inputs the loss
    has a gradient for (AOTAutograd wants a gradient for every parameter)."""
    weights = loss_weights(case.graph, seed)
    if not weights:
        raise PathSkipped("no float output")
    floats = [t.is_floating_point() for t in case.inputs]
    module = LossModule(case.graph, case.inputs, weights, floats)
    try:
        loss = module(*runtime_inputs(case.inputs, floats))
        if not loss.requires_grad:
            raise PathSkipped("the loss does not depend on a float input")
        grads = torch.autograd.grad(loss, list(module.params), allow_unused=True)
    except RuntimeError as err:
        raise PathSkipped(f"eager has no gradient: {str(err).splitlines()[0][:100]}") from None
    if not torch.isfinite(loss) or any(g is not None and not torch.isfinite(g).all() for g in grads):
        raise PathSkipped("eager's loss or gradient is not finite (a kink such as sqrt at 0)")
    received = iter(g is not None for g in grads)
    trainable = [next(received) if f else False for f in floats]
    if not any(trainable):
        raise PathSkipped("no float input gets a gradient")
    return trainable


def train_reference(case: oracle.Case, seed: int, trainable, f64: bool = False):
    """Eager loss and gradients (float64 throughout with `f64`)."""
    inputs, constants = case.inputs, case.graph.constants
    cast = (lambda t: t.double() if t.is_floating_point() else t) if f64 else (lambda t: t)
    weights = loss_weights(case.graph, seed, (lambda d: torch.float64) if f64 else None)
    default = torch.get_default_dtype()
    if f64:
        torch.set_default_dtype(torch.float64)
    try:
        module = LossModule(case.graph, [cast(t) for t in inputs], weights, trainable,
                            {k: cast(v) for k, v in constants.items()})
        if f64:
            _promote_attrs(module)
        loss = module(*[cast(t) for t in runtime_inputs(inputs, trainable)])
        grads = torch.autograd.grad(loss, list(module.params))
    finally:
        torch.set_default_dtype(default)
    return loss.detach(), [g.detach() for g in grads]


def _promote_attrs(module: LossModule) -> None:
    steps = module.graph_module._steps
    for k, (impl, ins, attrs, outs) in enumerate(steps):
        attrs = {a: oracle._promote_dtype(v) for a, v in attrs.items()}
        steps[k] = (impl, ins, attrs, outs)


def run_train(case: oracle.Case, seed: int, trainable):
    import opweave

    module = LossModule(case.graph, case.inputs, loss_weights(case.graph, seed), trainable)
    args = runtime_inputs(case.inputs, trainable)
    step = opweave.compile(module, args, train=True, name="fuzz")
    if not step.graphs:
        raise Fallback("the training step was not captured (runs in eager)")
    loss = step(*args)
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in module.params]
    return loss.detach(), grads


# -- one case, one path --------------------------------------------------------------------
_OPWEAVE_WARNINGS = ("opweave", "fusion")


def check_path(path: str, case: oracle.Case, seed: int = 0, expected=None) -> Outcome:
    """Run `case` through `path` and compare with eager. `expected`: the eager and
    shadow results if already computed (outputs, or loss and gradients for train)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices._WARNED.clear()  # each graph's fallbacks are news
        try:
            problem = _run_and_compare(path, case, seed, expected)
            error = None
        except Exception as err:  # noqa: BLE001  (sorted out below)
            problem, error = "", err
    notes = [str(w.message) for w in caught if _is_fallback(w)]
    if isinstance(error, PathSkipped):
        return Outcome(path, "skip", "skip", str(error))
    bugs = [n for n in notes if not _is_coverage_gap(n)]
    if isinstance(error, Fallback) or bugs:
        return Outcome(path, "fail", "fallback", "; ".join([str(error or "")] + bugs).strip("; ")[:600])
    if error is not None:
        first = (str(error).strip().splitlines() or [""])[0]
        return Outcome(path, "fail", f"error: {type(error).__name__}", first[:400])
    if problem:
        return Outcome(path, "fail", "rules" if path == RULES else "mismatch", problem)
    return Outcome(path, "pass", "coverage" if notes else "", "; ".join(notes)[:600])


def _is_coverage_gap(message: str) -> bool:
    """An op opweave deliberately leaves to eager (no lowering, or a use it declines),
    as opposed to a pass that crashed or a lowering that raised."""
    if not message.startswith("opweave runs these ops in eager PyTorch:"):
        return False
    return not re.search(r"\((\w+Error|lowering gives)", message)


def _is_fallback(w: warnings.WarningMessage) -> bool:
    from ..codegen import FusionWarning
    from ..frontends.program import OpweaveFallbackWarning

    return issubclass(w.category, (OpweaveFallbackWarning, FusionWarning))


def expected_results(path: str, case: oracle.Case, seed: int):
    if path == "train":
        trainable = trainable_inputs(case, seed)
        return (trainable, train_reference(case, seed, trainable),
                train_reference(case, seed, trainable, f64=True))
    return oracle.run_eager(case.graph, case.inputs), oracle.run_shadow(case.graph, case.inputs)


def _run_and_compare(path: str, case: oracle.Case, seed: int, expected) -> str:
    if path == "rules":
        try:
            oracle.evaluate(case.graph, case.inputs, types=True)
        except oracle.RuleMismatch as err:
            return str(err)
        return ""
    if expected is None:
        expected = expected_results(path, case, seed)
    floor = least_precise_float(case.graph)
    if path == "train":
        trainable, eager, shadow = expected
        loss, grads = run_train(case, seed, trainable)
        (e_loss, e_grads), (s_loss, s_grads) = eager, shadow
        return (compare([loss], [e_loss], [s_loss], "loss", floor)
                or compare(grads, e_grads, s_grads, "gradient", floor))
    eager, shadow = expected
    runner = {"compile": run_compile, "dynamo": run_dynamo, "onnx": run_onnx}[path]
    return compare(runner(case), eager, shadow, least_precise=floor)


def least_precise_float(graph) -> torch.dtype | None:
    """The float type of the graph's values with the largest epsilon, if any."""
    floats = {v.type.dtype for v in graph.inputs} | {
        v.type.dtype for n in graph.nodes for v in n.outputs}
    floats = [d for d in floats if d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps) if floats else None
