"""IR graphs as torch modules, for the frontends to capture.

`GraphModule.forward` calls each node's reference implementation in order: plain torch
code, which torch.export and Dynamo capture into the ATen graphs opweave lowers, and
which, run directly, is the eager oracle. Constants become buffers (frozen by
`opweave.compile`, inputs to the Dynamo graph).

`LossModule` is the training form: float graph inputs become parameters, the loss is
a fixed random weighting of the float outputs (so no two gradients are alike by symmetry).
"""
from __future__ import annotations

import torch

from ..ir import Graph


class GraphModule(torch.nn.Module):
    def __init__(self, graph: Graph, constants: dict | None = None):
        super().__init__()
        constants = graph.constants if constants is None else constants
        slots = {v: i for i, v in enumerate(graph.inputs)}
        self._buffer_of = {}
        steps = []
        for node in graph.nodes:
            if node.op == "constant":
                name = f"c{len(self._buffer_of)}"
                self.register_buffer(name, constants[node.attrs["name"]].clone())
                self._buffer_of[len(slots)] = name
                slots[node.outputs[0]] = len(slots)
                continue
            ins = [slots[v] for v in node.inputs]
            outs = []
            for v in node.outputs:
                slots[v] = len(slots)
                outs.append(slots[v])
            steps.append((node.opdef.impl, ins, dict(node.attrs), outs))
        self._steps = steps
        self._slots = len(slots)
        self._inputs = len(graph.inputs)
        self._outputs = [slots[v] for v in graph.outputs]

    def forward(self, *inputs):
        env = list(inputs) + [None] * (self._slots - len(inputs))
        for slot, name in self._buffer_of.items():
            env[slot] = getattr(self, name)
        for impl, ins, attrs, outs in self._steps:
            result = impl(*[env[i] for i in ins], **attrs)
            if len(outs) == 1:
                env[outs[0]] = result
            else:
                for slot, value in zip(outs, result):
                    env[slot] = value
        return tuple(env[i] for i in self._outputs)


class LossModule(torch.nn.Module):
    """`forward(*other_inputs)` -> scalar loss; the graph inputs marked in `trainable`
    (float ones) are parameters, the others are the forward's arguments, in order."""

    def __init__(self, graph: Graph, inputs, weights, trainable, constants: dict | None = None):
        super().__init__()
        self.graph_module = GraphModule(graph, constants)
        self._is_param = list(trainable)
        self.params = torch.nn.ParameterList(
            [torch.nn.Parameter(t.detach().clone()) for t, p in zip(inputs, trainable) if p])
        self._weighted = list(weights)  # output indices (float outputs only)
        for i, w in weights.items():
            self.register_buffer(f"w{i}", w)

    def forward(self, *rest):
        params, rest = iter(self.params), iter(rest)
        inputs = [next(params) if p else next(rest) for p in self._is_param]
        outputs = self.graph_module(*inputs)
        terms = [(outputs[i] * getattr(self, f"w{i}")).sum() for i in self._weighted]
        loss = terms[0]
        for term in terms[1:]:
            loss = loss + term
        return loss


def runtime_inputs(inputs, trainable) -> list[torch.Tensor]:
    """The arguments a LossModule takes: the graph inputs that are not parameters."""
    return [t for t, p in zip(inputs, trainable) if not p]


def loss_weights(graph: Graph, seed: int, dtype_map=None) -> dict[int, torch.Tensor]:
    """A fixed random weight for each float output (drawn in float64, cast to its dtype)."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for i, v in enumerate(graph.outputs):
        if v.type.dtype.is_floating_point:
            w = torch.rand(v.type.shape, generator=gen, dtype=torch.float64) + 0.5
            weights[i] = w.to(dtype_map(v.type.dtype) if dtype_map else v.type.dtype)
    return weights
