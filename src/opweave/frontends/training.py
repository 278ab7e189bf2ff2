"""`opweave.compile(model, inputs, train=True)`: a training step as one joint graph.

AOTAutograd traces the model's loss and its gradients together (the backward seeded with
1, since d loss / d loss is known before anything runs). opweave compiles that joint
graph like any other, so forward and backward fuse and free memory as one program. A
call runs the whole graph and returns the loss attached to autograd: `loss.backward()`
hands the precomputed gradients to the parameters, scaled by the incoming gradient, so
the usual `loss.backward(); optimizer.step()` loop is unchanged.

Loss elimination (EVT): the gradients do not need the loss value. With `loss_every=N`,
only every N-th call computes it; the other calls run a second compilation of the joint
graph without the loss output, whose loss-only nodes are dead and removed.
See docs/training.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.fx as fx

from .decompositions import decomposition_table, ops_kept_whole
from ..notices import warn_once
from ..options import Options
from .program import CompiledProgram, OpweaveFallbackWarning


class LossNotScalar(TypeError):
    """The model given to `opweave.compile(train=True)` does not return a scalar loss."""


class _LossAsTuple(torch.nn.Module):
    """AOTAutograd's joint export wants tuple outputs; the model returns a bare loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self._checked(self.model(*inputs))

    def _checked(self, loss) -> tuple[torch.Tensor]:
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise LossNotScalar("opweave.compile(train=True) needs a model that returns a "
                                f"scalar loss tensor; {type(self.model).__name__} returned "
                                f"{_describe(loss)}")
        return (loss,)


class _DistinctGradients(_LossAsTuple):
    """The same step, each parameter read through `p * 1.0`, so that its gradient is a
    node of its own. aot_export_module maps gradients to parameters by output name, and
    fails when two parameters get the very same gradient node (`p + q`: both receive
    the incoming gradient); the multiplications give each one its own node."""

    def forward(self, *inputs):
        params = {name: p * 1.0 for name, p in self.model.named_parameters()}
        return self._checked(torch.func.functional_call(self.model, params, inputs))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


@dataclass
class JointGraph:
    """The traced training step: placeholders are parameters, buffers, then user inputs;
    outputs are mutated buffers, the loss, then gradients."""

    gm: fx.GraphModule
    params: list[str]  # names in the model, in placeholder order
    buffers: list[str]
    mutated_buffers: list[str]  # in output order
    grads: list[str]  # the parameter each gradient output belongs to, in output order
    loss_index: int  # position of the loss among the outputs


_PREFIX = "model."


def capture_joint(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor]) -> JointGraph:
    from torch._functorch.aot_autograd import aot_export_module
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedFakeTensorException

    def export(wrapper, inputs):
        with ops_kept_whole():
            return aot_export_module(wrapper(model), inputs, trace_joint=True,
                                     output_loss_index=0, decompositions=decomposition_table())

    def trace(inputs):
        try:
            return export(_LossAsTuple, inputs)
        except AssertionError as err:
            if "backward_output_names" not in str(err):
                raise
            return export(_DistinctGradients, inputs)  # two parameters shared one gradient node

    # Traced on fake inputs: given real ones, the export computes the whole step for real
    # and holds it (BERT-base, batch 4, sequence 512: 6 GiB above an eager step's peak).
    # Sparse tensors (GCN's adjacency) cannot be faked; such a model is traced on its real
    # inputs, as before.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        fakes = tuple(fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                      for x in example_inputs)
        gm, sig = trace(fakes)
    except UnsupportedFakeTensorException:
        gm, sig = trace(tuple(example_inputs))
    strip = lambda name: name[len(_PREFIX):] if name.startswith(_PREFIX) else name  # noqa: E731
    outputs = [a.name for a in _output_node(gm).args[0]]
    grads_by_output = sig.backward_signature.gradients_to_parameters
    # Not backward_signature.loss_output: with buffer mutations it names the first output.
    (loss_name,) = sig.user_outputs
    joint = JointGraph(
        gm=gm,
        params=[strip(n) for n in sig.parameters],
        buffers=[strip(n) for n in sig.buffers],
        mutated_buffers=[strip(sig.buffers_to_mutate[o]) for o in outputs
                         if o in sig.buffers_to_mutate],
        grads=[strip(grads_by_output[o]) for o in outputs if o in grads_by_output],
        loss_index=outputs.index(loss_name),
    )
    if joint.loss_index != len(joint.mutated_buffers) or \
            len(outputs) != joint.loss_index + 1 + len(joint.grads):
        raise RuntimeError(f"unexpected joint graph outputs {outputs} (expected mutated "
                           "buffers, the loss, then gradients)")
    return joint


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


_SHAPE_ONLY = {torch.ops.aten.full_like.default: None, torch.ops.aten.ones_like.default: 1,
               torch.ops.aten.zeros_like.default: 0}


def eliminate_loss(gm: fx.GraphModule, loss_index: int) -> fx.GraphModule:
    """The joint graph without its loss output, and without every node that only the
    loss needed (EVT's loss elimination). AOTAutograd seeds the backward with
    `full_like(loss, 1)`, which reads the loss only for its shape; the seed becomes a
    constant, so nothing keeps the loss alive. The output keeps its arity: the loss
    position holds None."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    out = _output_node(gm)
    values = list(env[out].args[0])
    loss, values[loss_index] = values[loss_index], None
    env[out].args = (tuple(values),)
    example = loss.meta.get("val")
    for user in list(loss.users):
        if user.target not in _SHAPE_ONLY or example is None:
            continue
        fill = _SHAPE_ONLY[user.target]
        fill = user.args[1] if fill is None else fill
        with graph.inserting_before(user):
            seed = graph.call_function(torch.ops.aten.full.default, (list(example.shape), fill),
                                       {"dtype": user.kwargs.get("dtype") or example.dtype,
                                        "device": example.device, "pin_memory": False})
        seed.meta = dict(user.meta)
        user.replace_all_uses_with(seed)
        graph.erase_node(user)
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


class _PrecomputedGradients(torch.autograd.Function):
    """Returns the loss; its backward returns gradients computed in the same call.
    The joint graph was seeded with d loss = 1, and gradients are linear in the seed,
    so any other incoming gradient just scales them."""

    @staticmethod
    def forward(ctx, loss, grads, *params):
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("opweave: backward through a compiled training step ran twice; "
                               "each call's gradients can be used once")
        scale = None if bool(grad_loss == 1) else grad_loss
        return (None, None, *[g if g is None or scale is None else g * scale for g in grads])


class _JointStep:
    """The training step compiled for one set of input shapes: the joint graph, and its
    programs with and without the loss (each compiled on first use)."""

    def __init__(self, model: torch.nn.Module, example_inputs, name: str, options: dict):
        self.name = name
        self.options = options
        wanting = [i for i, x in enumerate(example_inputs)
                   if isinstance(x, torch.Tensor) and x.requires_grad]
        if wanting:
            raise NotImplementedError(f"input(s) {wanting} require grad; the joint graph "
                                      "computes parameter gradients only")
        self.joint = capture_joint(model, example_inputs)
        named_params = dict(model.named_parameters())
        named_buffers = dict(model.named_buffers())
        self.params = [named_params[n] for n in self.joint.params]
        self.buffers = [named_buffers[n] for n in self.joint.buffers]
        self.mutated = [named_buffers[n] for n in self.joint.mutated_buffers]
        # sparse buffers are bound into the programs as constants; the rest are arguments
        self.runtime_buffers = [b for b in self.buffers if not b.is_sparse]
        self.grad_params = [named_params[n] for n in self.joint.grads]
        self.programs: dict[bool, CompiledProgram] = {}

    def program(self, with_loss: bool) -> CompiledProgram:
        if with_loss not in self.programs:
            joint = self.joint
            gm = joint.gm if with_loss else eliminate_loss(joint.gm, joint.loss_index)
            suffix = "" if with_loss else "_noloss"
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            buffer_nodes = placeholders[len(self.params):len(self.params) + len(self.buffers)]
            # Sparse buffers (GCN's adjacency) are bound as constants, as in inference:
            # the IR takes sparse operands only as constants.
            constants = {node: b for node, b in zip(buffer_nodes, self.buffers) if b.is_sparse}
            program = CompiledProgram(gm, constants, name=f"{self.name}_train{suffix}",
                                      options=self.options)
            program.warn_fallbacks()
            self.programs[with_loss] = program
        return self.programs[with_loss]

    def run(self, inputs, with_loss: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step: (loss or NaN, gradients); buffers updated in place."""
        program = self.program(with_loss)
        with torch.no_grad():
            outputs = program(*[p.detach() for p in self.params], *self.runtime_buffers, *inputs)
            for buffer, value in zip(self.mutated, outputs):
                buffer.copy_(value)
        index = self.joint.loss_index
        loss = outputs[index] if with_loss else torch.tensor(math.nan)
        return loss, list(outputs[index + 1:])


def _signature(inputs) -> tuple:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in inputs)


class TrainingModel:
    """A model compiled for training; `model(*inputs)` returns the loss (see module doc).
    Inputs of new shapes (a smaller last batch) compile the step again, once per shape."""

    def __init__(self, model: torch.nn.Module, example_inputs, *, name: str,
                 options: Options | None = None, loss_every: int | None = 1):
        if loss_every is not None and (not isinstance(loss_every, int) or loss_every < 1):
            raise ValueError(f"loss_every must be a positive int or None, not {loss_every!r}")
        self.model = model
        self.name = name
        self.loss_every = loss_every
        self._options = float32_training(Options.resolve(options))
        self._steps: dict[tuple, _JointStep | None] = {}  # None: runs in eager
        self.calls = 0
        self.training = model.training  # the mode the graph was captured in
        step = self._step(tuple(example_inputs))
        if step is not None:
            step.program(self.wants_loss())  # compile now, not inside the first step

    def _step(self, inputs) -> _JointStep | None:
        key = _signature(inputs)
        if key not in self._steps:
            try:
                self._steps[key] = _JointStep(self.model, inputs, self.name, self._options)
            except LossNotScalar:  # the model's own contract is the user's to fix
                raise
            except Exception as err:  # capture failures are reported, never fatal
                self._steps[key] = None
                warnings.warn(f"opweave could not capture the training step of {self.name}; "
                              f"it runs in eager PyTorch ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]})", OpweaveFallbackWarning,
                              stacklevel=4)
        return self._steps[key]

    @property
    def programs(self) -> dict[bool, CompiledProgram]:
        """The compiled programs (with loss: True, without: False) of the example shapes."""
        first = next(iter(self._steps.values()))
        return first.programs if first is not None else {}

    def wants_loss(self) -> bool:
        """Whether the next call computes the loss value."""
        return self.loss_every is not None and self.calls % self.loss_every == 0

    def __call__(self, *inputs):
        if self.model.training != self.training:
            warn_once(f"{self.name} was compiled for training in "
                      f"{'train' if self.training else 'eval'} mode and is now in the other; "
                      "it runs in eager PyTorch until switched back", OpweaveFallbackWarning)
            return self.model(*inputs)
        step = self._step(inputs)
        if step is None:
            return self.model(*inputs)
        with_loss = self.wants_loss()
        self.calls += 1
        params = step.grad_params
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in params):
            return step.run(inputs, with_loss)[0]
        # No tensor is bound in this frame: a library that keeps the frames of an import
        # (as a traceback) would otherwise keep this step's gradients alive.
        return _PrecomputedGradients.apply(*step.run(inputs, with_loss), *params)

    @property
    def graphs(self):
        return [g for step in self._steps.values() if step is not None
                for p in step.programs.values() for g in p.graphs]


def float32_training(options: Options) -> Options:
    """The options a training graph compiles with: float32, saying so once when another
    precision was asked for (it applies to inference graphs; mixed-precision training,
    with float32 master weights, is not built)."""
    if options.precision == "fp32":
        return options
    warn_once(f"opweave: training graphs compute in float32; precision={options.precision!r} "
              "applies to inference graphs only", OpweaveFallbackWarning)
    return replace(options, precision="fp32")
