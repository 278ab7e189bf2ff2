"""Which sets of nodes may run as one kernel (correctness only; what pays is policy.py).

Two kinds of fused group:
- an anchor group: a linear layer or convolution plus an epilogue chain the library
  applies as post-ops (oneDNN): bias, then one activation, or a residual add (for a
  convolution, a residual add then ReLU), with reshapes passing through;
- a generated kernel: one-to-one ops over one iteration space, with at most one
  reduction: a row reduction (softmax, log-softmax, layer norm, or a sum or mean along the
  last axis) whose prologue and epilogue they form, or a column sum they feed, which
  nothing in the kernel reads (its result is complete only after the last row).
Every refusal returns the reason, for the debug dump.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ir.graph import Node
from .classify import Role, constant_of, iteration_shape
from .context import Context

LINEAR_UNARY = frozenset({"relu", "gelu", "tanh", "sigmoid", "clamp"})
CONV_UNARY = frozenset({"relu", "tanh", "sigmoid", "clamp"})


@dataclass
class Epilogue:
    """The post-ops of an anchor group, in the form the library takes them."""

    bias: Node | None = None          # the add of a constant bias (linear layers)
    unary: Node | None = None         # activation after bias / after the residual add
    binary: Node | None = None        # residual add of another tensor
    chain: tuple[Node, ...] = ()      # the members after the anchor, in order

    @property
    def last(self) -> Node | None:
        return self.chain[-1] if self.chain else None


def monotone_violation(ctx: Context, members) -> str | None:
    """Reasons no superset of `members` can be legal (used to prune enumeration)."""
    roles = [ctx.role[n] for n in members]
    if Role.OPAQUE in roles:
        return "contains an op that runs only as a library call"
    anchors = roles.count(Role.ANCHOR)
    if anchors > 1:
        return "two contractions in one kernel"
    if anchors:
        if Role.ROW_REDUCE in roles or Role.COLUMN_SUM in roles:
            return "a reduction cannot be a library post-op"
        return None
    if Role.VIEW in roles:
        return "views join only an anchor's epilogue"
    if roles.count(Role.ROW_REDUCE) + roles.count(Role.COLUMN_SUM) > 1:
        return "two reductions in one kernel"
    shapes = {iteration_shape(n) for n in members}
    if len(shapes) > 1:
        return f"different iteration spaces {sorted(shapes)}"
    return None


def why_illegal(ctx: Context, members: frozenset[Node]) -> str | None:
    """None if `members` may run as one kernel, else why not."""
    if len(members) == 1:
        return None
    bad = monotone_violation(ctx, members)
    if bad:
        return bad
    if not ctx.is_convex(members):
        return "a path leaves the group and re-enters it (the kernel would depend on itself)"
    if any(ctx.role[n] is Role.ANCHOR for n in members):
        epilogue = anchor_epilogue(ctx, members)
        return epilogue if isinstance(epilogue, str) else None
    for n in members:
        if ctx.role[n] is Role.COLUMN_SUM and any(u in members for u in ctx.users.get(n.outputs[0], [])):
            return "a column sum is read inside its kernel (it is complete only after the last row)"
        if n.op == "layer_norm" and any(ctx.users.get(v) or v in ctx.graph_outputs
                                        for v in n.outputs[1:]):
            # the row kernel keeps its mean and rstd in registers: nothing can read them
            return "layer norm statistics are read (the kernel does not store them)"
        if n.outputs[0].type.dtype == torch.bool and ctx.escapes(n.outputs[0], members):
            # g++ does not vectorize a loop that stores bytes next to floats (measured
            # 30x slower); a comparison fuses with the select that reads it instead
            return "a comparison's result is read outside the kernel"
    return None


def anchor_epilogue(ctx: Context, members) -> Epilogue | str:
    """The anchor group's post-ops, or why they are not a chain the library can apply."""
    anchor = next(n for n in members if ctx.role[n] is Role.ANCHOR)
    rest = set(members) - {anchor}
    ep = Epilogue()
    chain = []
    cur = anchor
    out_numel = anchor.outputs[0].type.numel
    while rest:
        value = cur.outputs[0]
        users = ctx.users.get(value, [])
        if value in ctx.graph_outputs or len(users) != 1 or users[0] not in rest:
            return f"{cur.op} output is read outside the epilogue chain"
        nxt = users[0]
        rest.discard(nxt)
        chain.append(nxt)
        cur = nxt
        if nxt.op == "reshape":
            continue
        if ep.unary is not None:
            return f"{nxt.op} after the activation post-op"
        if nxt.op == "add" and ep.binary is None:
            other = [v for v in nxt.inputs if v is not value]
            if len(other) != 1:
                return "add of a value to itself"
            if (anchor.op == "matmul" and ep.bias is None and not chain[:-1]
                    and _is_row_bias(ctx, other[0], anchor)):
                ep.bias = nxt
                continue
            if other[0].type.numel != out_numel or other[0].type.shape != nxt.outputs[0].type.shape:
                return "residual add needs an operand of the output's shape"
            if ctx.producer_in(other[0], members):
                return "residual operand computed inside the group"
            if anchor.op == "matmul" and ctx.float32_residuals:
                return "a bf16 product's residual add stays float32 (docs/precision.md)"
            ep.binary = nxt
            continue
        allowed = LINEAR_UNARY if anchor.op == "matmul" else CONV_UNARY
        if nxt.op in allowed and (ep.binary is None or anchor.op == "conv"):
            if nxt.op == "gelu" and nxt.attrs["approximate"] not in ("none", "tanh"):
                return "unknown gelu approximation"
            if nxt.op == "clamp" and not _two_finite_bounds(nxt):
                return "a clamp without both bounds is not a post-op"
            ep.unary = nxt
            continue
        return f"{nxt.op} is not a {anchor.op} post-op here"
    if chain and chain[-1].op == "reshape":
        return "an epilogue does not end in a view"
    ep.chain = tuple(chain)
    return ep


def _two_finite_bounds(clamp: Node) -> bool:
    """Whether a clamp has a finite lower and upper bound (ReLU6 is clamp(x, 0, 6)): the
    library's clip post-op, torch's "hardtanh" attribute."""
    bounds = (clamp.attrs["min"], clamp.attrs["max"])
    return all(isinstance(b, (int, float)) and math.isfinite(b) for b in bounds) \
        and bounds[0] <= bounds[1]


def _is_row_bias(ctx: Context, value, anchor: Node) -> bool:
    n = anchor.outputs[0].type.shape[-1]
    return value.type.shape in ((n,), (1, n)) and constant_of(ctx.graph, value) is not None
