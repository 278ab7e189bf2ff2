"""An anchor group (a linear layer or convolution with its epilogue) as the library forms
see it, in every precision (codegen/library.py, library_int8.py): the values it reads,
its activation in torch's and in oneDNN's terms, a convolution's geometry, the shape of
its result, and whether oneDNN's own library can run it."""
from __future__ import annotations

import torch

from .. import shared_constants
from ..ir.graph import Node, Value
from ..partition.classify import constant_of
from ..partition.legality import Epilogue
from . import onednn_direct

_UNARY = {"relu": ("relu", [], ""), "tanh": ("tanh", [], ""), "sigmoid": ("sigmoid", [], "")}


def supports() -> bool:
    """Whether the library form applies (torch was built with oneDNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def group_inputs(anchor: Node, ep: Epilogue) -> list[Value]:
    """The values an anchor group reads at run time (weights and bias are baked in)."""
    ins = [anchor.inputs[0]]
    if ep.binary is not None:
        chained = {anchor.outputs[0]} | {n.outputs[0] for n in ep.chain}
        ins += [v for v in ep.binary.inputs if v not in chained]
    return ins


def shaped(y: torch.Tensor, shape) -> torch.Tensor:
    """`y` viewed as `shape`, untouched when it already has it: a view re-derives the
    strides of size-1 axes, and torch then no longer sees a channels-last tensor as one
    (max pooling copied it to NCHW and ran 18x slower)."""
    return y if tuple(y.shape) == tuple(shape) else y.view(shape)


def torch_unary(ep: Epilogue):
    """The epilogue's activation as torch's oneDNN ops take it: (attr, scalars, algorithm)."""
    if ep.unary is None:
        return "none", [], ""
    if ep.unary.op == "gelu":
        return "gelu", [], ep.unary.attrs["approximate"]
    if ep.unary.op == "clamp":
        return "hardtanh", [float(ep.unary.attrs["min"]), float(ep.unary.attrs["max"])], ""
    return _UNARY[ep.unary.op]


def bias_input(anchor: Node, ep: Epilogue) -> Value | None:
    """The bias a linear group adds to its product, if any."""
    if ep.bias is None:
        return None
    return next(v for v in ep.bias.inputs if v is not anchor.outputs[0])


def pointwise_conv(anchor: Node) -> bool:
    a = anchor.attrs
    w = anchor.inputs[1].type.shape
    return (len(w) == 4 and w[2:] == (1, 1) and a["stride"] == [1, 1] and a["padding"] == [0, 0]
            and a["groups"] == 1 and anchor.inputs[0].type.shape[0] == 1)


def as_2d(anchor: Node):
    """(one_d, input size, padding, stride, dilation) of a convolution as oneDNN runs it:
    a 1-D one as 2-D over a height of 1."""
    a = anchor.attrs
    size = list(anchor.inputs[0].type.shape)
    padding, stride, dilation = a["padding"], a["stride"], a["dilation"]
    one_d = len(size) == 3
    if one_d:
        size = size[:2] + [1] + size[2:]
        padding, stride, dilation = [0] + padding, [1] + stride, [1] + dilation
    return one_d, size, padding, stride, dilation


def conv_views(one_d: bool, out_shape):
    """(to_2d, finish) of a convolution run as 2-D: a 1-D one's operands viewed over a
    height of 1, and its result viewed back, as the group's output shape."""
    def to_2d(t):
        return t.unsqueeze(2) if one_d else t

    def finish(y):
        return shaped(y.squeeze(2) if one_d else y, out_shape)
    return to_2d, finish


def direct_offered() -> bool:
    """Whether the form "onednn-direct" is offered here: oneDNN's library is available,
    and the graph is compiled for one size. A primitive packs its weights for its own
    shapes, so the plans of a graph compiled for many sizes (docs/dynamic.md) would each
    hold a copy of them, where torch's packs are shared between them."""
    return not shared_constants.in_scope() and onednn_direct.library() is not None


def direct_fits(anchor: Node, ep: Epilogue) -> bool:
    """Whether oneDNN's own library can run the group: a float32 product [M, K] x [K, N]
    or 1-D or 2-D convolution, no size 0, whose epilogue is one of its post-ops (torch's
    forms take the same ones)."""
    if any(0 in v.type.shape for v in anchor.inputs):
        return False
    floats = all(v.type.dtype == torch.float32 for v in anchor.inputs)
    rank = len(anchor.inputs[0].type.shape)
    if rank not in ((2,) if anchor.op == "matmul" else (3, 4)):
        return False
    return floats and direct_unary(ep) in onednn_direct.UNARY


def direct_unary(ep: Epilogue):
    """The epilogue's activation as `onednn_direct.UNARY` names it ("unknown" if none)."""
    if ep.unary is None:
        return None
    if ep.unary.op == "gelu":
        return "gelu", ep.unary.attrs["approximate"]
    if ep.unary.op == "clamp":
        bounds = ("clamp", float(ep.unary.attrs["min"]), float(ep.unary.attrs["max"]))
        return bounds if bounds in onednn_direct.UNARY else "unknown"
    return ep.unary.op if ep.unary.op in onednn_direct.UNARY else "unknown"


def direct_geometry(graph, anchor):
    """(one_d, weight, geometry) of a convolution as `onednn_direct.DirectConv` takes it,
    1-D ones as 2-D over a height of 1 as in `_conv`."""
    one_d, size, padding, stride, dilation = as_2d(anchor)
    weight = constant_of(graph, anchor.inputs[1])
    weight = weight.unsqueeze(2) if one_d else weight
    geometry = (*size, weight.shape[0], *weight.shape[2:], anchor.attrs["groups"],
                *stride, *padding, *dilation)
    return one_d, weight, geometry
