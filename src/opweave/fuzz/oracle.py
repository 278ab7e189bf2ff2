"""Input data and the eager oracle: each node's reference implementation, run in order.

Random graphs have preconditions no rule states: indices in range, logs of positives,
no integer division by zero. Rather than know them, `draw` tries a ladder of input
distributions and keeps the first on which eager PyTorch runs and every float value it
computes is finite and moderate; a graph that fails every rung is rejected.

`shadow` runs the same graph in float64. The distance between the float32 eager result
and it measures how ill-conditioned the graph is at these inputs; the tolerances allow a
backend that much error (a near-cancelling sum, a reciprocal of a small difference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir import Graph, TensorType

LIMIT = 1e4  # larger float intermediates make the graph too ill-conditioned to compare


@dataclass
class Case:
    """A graph with its input tensors (in graph-input order) and its constants filled."""

    graph: Graph
    inputs: list[torch.Tensor]


class Rejected(Exception):
    """The graph has no inputs on which eager runs cleanly; it is not a test."""


class RuleMismatch(Exception):
    """A node's reference implementation computed other types than its rules declare."""


# (float low, float high, int low, int high): int values are drawn from [low, high)
LADDER = [(-3.0, 3.0, -4, 5), (0.5, 2.0, 0, 3), (0.5, 1.5, 0, 2), (0.5, 1.5, 0, 1)]


def _tensor(shape, dtype, rung, gen: torch.Generator) -> torch.Tensor:
    flo, fhi, ilo, ihi = rung
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (fhi - flo) + flo).to(dtype)
    return torch.randint(ilo, ihi, shape, generator=gen).to(dtype)


def evaluate(graph: Graph, inputs, constants=None, *, f64: bool = False, check: bool = False,
             types: bool = False):
    """Every value's eager result (value -> tensor); `f64` promotes floats to float64.
    `check` rejects non-finite or huge float values; `types` raises RuleMismatch where
    a result's type is not the one the graph declares."""
    constants = graph.constants if constants is None else constants
    env = {}
    for value, tensor in zip(graph.inputs, inputs):
        env[value] = _promote(tensor) if f64 else tensor
    for node in graph.nodes:
        if node.op == "constant":
            data = constants[node.attrs["name"]]
            results = [_promote(data) if f64 else data]
        else:
            attrs = {k: _promote_dtype(v) for k, v in node.attrs.items()} if f64 else node.attrs
            out = node.opdef.impl(*[env[v] for v in node.inputs], **attrs)
            results = list(out) if isinstance(out, (tuple, list)) else [out]
        if types:
            _check_types(node, results)
        for value, tensor in zip(node.outputs, results):
            if check:
                _check(node, tensor)
            env[value] = tensor
        if check and not f64:
            _check_integer_range(node, [env[v] for v in node.inputs], node.attrs)
    return env


def _check_types(node, results) -> None:
    got = [TensorType.of(t) if isinstance(t, torch.Tensor) else type(t).__name__ for t in results]
    declared = [v.type for v in node.outputs]
    if got != declared:
        raise RuleMismatch(f"{node.op} {node.attrs}: the rules give ({', '.join(map(str, declared))}), "
                           f"the implementation ({', '.join(map(str, got))})")


def _check(node, tensor) -> None:
    if tensor.is_floating_point() and tensor.numel():
        if not torch.isfinite(tensor).all() or tensor.abs().max() > LIMIT:
            raise Rejected(f"{node.op} computes non-finite or huge values")


def _check_integer_range(node, inputs, attrs) -> None:
    """An integer op whose exact result leaves int64 wraps around in torch, and other
    backends give other values (ONNX Runtime's integer Pow goes through a double and
    saturates): like a float overflow, such inputs are no test of a compiler. The op is
    run again in float64 to see its true magnitude; ops that do not run on floats pass."""
    if not node.outputs or node.outputs[0].type.dtype.is_floating_point \
            or node.outputs[0].type.dtype == torch.bool or node.opdef.is_view \
            or not all(isinstance(x, torch.Tensor) and not x.is_floating_point()
                       and x.dtype != torch.bool for x in inputs) or not inputs:
        return
    try:
        exact = node.opdef.impl(*[x.double() for x in inputs], **attrs)
    except Exception:  # noqa: BLE001  (bitwise and index ops take integers only)
        return
    for t in exact if isinstance(exact, (tuple, list)) else [exact]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() \
                and not (t.abs() < INT64_EDGE).all():
            raise Rejected(f"{node.op} overflows int64")


INT64_EDGE = 2.0 ** 63


def _promote(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def _promote_dtype(v):
    return torch.float64 if isinstance(v, torch.dtype) and v.is_floating_point else v


def run_eager(graph: Graph, inputs) -> list[torch.Tensor]:
    env = evaluate(graph, inputs)
    return [env[v] for v in graph.outputs]


def run_shadow(graph: Graph, inputs) -> list[torch.Tensor]:
    """The outputs computed in float64 (ops that make floats from ints too)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        env = evaluate(graph, inputs, f64=True)
    finally:
        torch.set_default_dtype(default)
    return [env[v] for v in graph.outputs]


def draw(graph: Graph, seed: int) -> Case:
    """Fill the graph's constants and draw inputs: the first rung of `LADDER` on which
    eager runs cleanly. Raises Rejected when none does."""
    why = ""
    for k, rung in enumerate(LADDER):
        gen = torch.Generator().manual_seed(seed * 31 + k)
        constants = {name: _tensor(t.shape, t.dtype, rung, gen)
                     for name, t in sorted(graph.constants.items())}
        inputs = [_tensor(v.type.shape, v.type.dtype, rung, gen) for v in graph.inputs]
        try:
            evaluate(graph, inputs, constants, check=True, types=True)
        except RuleMismatch:  # a finding, not a reason to reject: the "rules" check reports it
            graph.constants.update(constants)
            return Case(graph, inputs)
        except Rejected as err:
            why = str(err)
            continue
        except Exception as err:  # noqa: BLE001  (eager refuses these inputs)
            why = f"eager raises {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            continue
        graph.constants.update(constants)
        return Case(graph, inputs)
    raise Rejected(why)
