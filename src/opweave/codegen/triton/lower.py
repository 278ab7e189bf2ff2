"""Lowering for GPU tensors: the same partition as on the CPU, each fused group a Triton
kernel, each library call (matmul, convolution, attention) torch's CUDA library op.

An anchor group (a GEMM or convolution with its epilogue) becomes the library call, as
torch runs it on cuBLAS or cuDNN, followed by one Triton kernel for the epilogue (bias,
activation, residual add; a reshape that only regroups rows is free inside it): one
extra pass over the product where eager pays one per epilogue op. A linear layer's group
is also offered as one Triton GEMM template with the epilogue inside (gemm.py), chosen
by measurement. Groups whose members Triton cannot take (another dtype, mixed shapes)
run as torch ops.
"""
from __future__ import annotations

import math

from ...ir import Graph
from ...ir.graph import Node
from ...notices import warn_once
from ...partition import Role, partition
from ...partition.classify import iteration_shape
from .. import precision as prec
from ..render import FUSIBLE, ROW_REDUCE_OPS, ROW_SUM_OPS
from . import kernel
from .render import dtype_ok, keeps_rows, render

FUSED_ROLES = (Role.POINTWISE, Role.ROW_REDUCE, Role.COLUMN_SUM)


def lower_for_triton(graph: Graph, mode: str, ilp_seconds: float, precision: str, apart):
    """codegen.lower's steps for `target="triton"` (see the module's docstring)."""
    from ..lower import FusionWarning, Lowered, Step, _drop_unread, _topological, op_step, reference_fn

    if precision == "bf16x3":  # a CPU form (oneDNN's bf16 products with float32 results)
        warn_once("opweave: precision 'bf16x3' computes in float32 on the GPU",
                  FusionWarning)
        precision = "fp32"
    part = partition(graph, mode, FUSIBLE, ilp_seconds=ilp_seconds, apart=apart)
    ctx = part.ctx
    lowered = Lowered([], part, notes=list(part.notes))
    have_triton = kernel.available()
    unbuilt = 0
    for group in _topological(part):
        nodes = part.ordered(group)
        split_at = len(lowered.steps)
        for run in _runs(ctx, nodes):
            if len(run) <= 1 or not renderable(ctx, run):
                if len(run) > 1:
                    lowered.notes.append(f"a group of {len(run)} nodes ({', '.join(n.op for n in run)}) "
                                         "runs as torch ops: Triton's formulas do not cover it")
                lowered.steps += [op_step(n, precision) for n in run]
                continue
            members = frozenset(run)
            src = render(graph, run, lambda v, m=members: ctx.escapes(v, m))
            lowered.sources.append(src)
            if not have_triton:
                unbuilt += 1
                fn = reference_fn(graph, run, src.inputs, src.outputs)
                lowered.steps.append(Step(fn, src.inputs, src.outputs, run, "reference", src.name))
                continue
            fallback = reference_fn(graph, run, src.inputs, src.outputs)
            lowered.steps.append(Step(kernel.TritonKernel(src, fallback), src.inputs,
                                      src.outputs, run, "triton", src.name))
        if (have_triton and precision == "fp32" and ctx.role[nodes[0]] is Role.ANCHOR
                and nodes[0].op == "matmul"):  # (the template computes in float32)
            template = _gemm_step(nodes, lowered.steps[split_at:])
            if template is not None:
                lowered.steps[split_at:] = [template]
    if unbuilt:
        warn_once(f"opweave: Triton is not installed, so {unbuilt} fused groups run as separate "
                  "torch ops on the GPU (pip install 'opweave[triton]')", FusionWarning)
    _drop_unread(lowered, graph)
    if precision != "fp32":
        prec.hand_off_in_bf16(lowered.steps, graph.outputs)
    return lowered


def _gemm_step(nodes: list[Node], split: list):
    """A linear layer's group as one step choosing, by measurement, between the split
    steps (cuBLAS, then the epilogue) and the Triton template with the epilogue inside."""
    from ..lower import Step
    from .gemm import GemmChoice, GemmTemplateKernel, render_gemm, tf32_allowed

    anchor, chain = nodes[0], nodes[1:]
    if not chain:
        return None
    tf32 = tf32_allowed()
    src = render_gemm(anchor, chain, tf32)
    if src is None:
        return None
    made = {v for st in split for v in st.outputs}
    reads = {v for st in split for v in st.inputs if v not in made}
    outputs = src.outputs
    if reads != set(src.inputs) or any(v not in made for v in outputs):
        return None  # the two forms must take and give the same values
    template = GemmTemplateKernel(src, tf32)
    fn = GemmChoice(Sequence(split, src.inputs, outputs), template)
    return Step(fn, src.inputs, outputs, nodes, "triton", "+".join(n.op for n in nodes) + " (gemm)")


class Sequence:
    """Steps run as one function of `inputs` returning `outputs` (a group's split form)."""

    def __init__(self, steps: list, inputs, outputs):
        self.steps, self.inputs, self.outputs = steps, list(inputs), list(outputs)

    def __call__(self, *args):
        env = dict(zip(self.inputs, args))
        for st in self.steps:
            env.update(zip(st.outputs, st.fn(*[env[v] for v in st.inputs])))
        return [env[v] for v in self.outputs]


def _runs(ctx, nodes: list[Node]) -> list[list[Node]]:
    """A group cut where its nodes stop being fusible: an anchor group's library call and
    the views in its epilogue are steps of their own, in order, and the fusible nodes
    between them are runs (a kernel each)."""
    runs, current = [], []
    for n in nodes:
        if ctx.role[n] in FUSED_ROLES or (current and keeps_rows(n)):
            current.append(n)
            continue
        if current:
            runs.append(current)
            current = []
        runs.append([n])
    if current:
        runs.append(current)
    return runs


def renderable(ctx, nodes: list[Node]) -> bool:
    """Whether the nodes can be one Triton kernel: fusible roles (and reshapes that keep
    the rows), float32 or bool values, one iteration space. Past such a reshape, an
    operand must be of the full size or a row vector: the kernel reads those through
    the flat layout, the same before and after."""
    space = iteration_shape(nodes[0])
    if not dtype_ok(nodes) or any(ctx.role[n] not in FUSED_ROLES and not keeps_rows(n)
                                  for n in nodes):
        return False
    inside = {v for n in nodes for v in n.outputs}
    for n in nodes:
        shape = iteration_shape(n)
        if shape == space:
            continue
        if n.op in ROW_REDUCE_OPS | ROW_SUM_OPS or math.prod(shape) != math.prod(space) \
                or not shape or shape[-1] != space[-1]:
            return False
        for v in n.inputs:
            t = v.type
            if v in inside or t.numel == 1 or t.numel == math.prod(space) and t.shape[-1] == space[-1]:
                continue
            if t.numel == space[-1] and t.shape[-1] == space[-1]:
                continue  # a row vector (a bias): by column
            return False
    return True
