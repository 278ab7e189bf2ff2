"""What a fused group costs (the objective both partitioners minimize).

A kernel reads its external inputs once and writes the values read outside it; values
that stay inside never touch memory. Time is the roofline estimate of that traffic and the
group's arithmetic plus one launch: fusing saves the intermediate round trips and the
launches of the ops it absorbs. Legality lives in legality.py; this module only scores.
"""
from __future__ import annotations

from ..cost.model import Machine, active, node_seconds
from ..ir.graph import Node
from .classify import Role
from .context import Context


def group_seconds(ctx: Context, members, machine: Machine | None = None) -> float:
    if ctx.anchor_seconds is not None and any(ctx.role[n] is Role.ANCHOR for n in members):
        return ctx.anchor_seconds(ctx, frozenset(members))
    seconds = _roofline_seconds(ctx, members, machine)
    if ctx.conversion_seconds is not None:
        seconds += ctx.conversion_seconds(ctx, frozenset(members))
    return seconds


def _roofline_seconds(ctx: Context, members, machine: Machine | None) -> float:
    if len(members) == 1:
        (node,) = members
        return node_seconds(node.op, [v.type for v in node.inputs],
                            [v.type for v in node.outputs], node.attrs, machine)
    inputs = {v for n in members for v in n.inputs if not ctx.producer_in(v, members)}
    outputs = [v for n in members for v in n.outputs if ctx.escapes(v, members)]
    size = ctx.fused_bytes or (lambda ctx, v, members: v.type.nbytes)
    moved = sum(size(ctx, v, members) for v in (*inputs, *outputs))
    flops = sum(_flops(n) for n in members)
    return (machine or active()).seconds(flops, moved)


def _flops(node: Node) -> int:
    return node.opdef.cost([v.type for v in node.inputs], [v.type for v in node.outputs],
                           node.attrs).flops
