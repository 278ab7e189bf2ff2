"""Training through opweave: the joint graph (`opweave.compile(train=True)`) and the
torch.compile backend, against eager over several SGD steps; loss elimination."""
from __future__ import annotations

import copy
import math
import warnings
from collections import Counter

import pytest
import torch

import opweave
from opweave.frontends import torch_dynamo
from opweave.frontends.program import OpweaveFallbackWarning
from opweave.frontends.training import capture_joint, eliminate_loss
from opweave.models.base import disable_dropout

from ..conftest import MODEL_NAMES, small_model

ATOL = 1e-4


def _pair(name):
    """Two identical train-mode copies of a small model's loss module (the cached model
    itself is left untouched)."""
    bench = small_model(name)
    reference = disable_dropout(copy.deepcopy(bench.loss_module)).train()
    return bench, reference, copy.deepcopy(reference)


def _sgd_step(fn, module, optimizer, args):
    optimizer.zero_grad(set_to_none=True)
    loss = fn(*args)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _assert_same_state(got: torch.nn.Module, expected: torch.nn.Module):
    for (name, e), g in zip(expected.named_parameters(), got.parameters()):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for (name, e), g in zip(expected.named_buffers(), got.buffers()):
        if e.is_floating_point() and not e.is_sparse:
            torch.testing.assert_close(g, e, atol=ATOL, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ["joint", "dynamo"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_three_sgd_steps_match_eager(name, path):
    """Batch norm runs in train mode (batch statistics, running-stat updates)."""
    bench, reference, module = _pair(name)
    args = (*bench.inputs, bench.targets)
    before = torch_dynamo.compiled_graphs.mark()
    if path == "joint":
        step = opweave.compile(module, args, train=True)
    else:
        step = torch.compile(module, backend="opweave")
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        expected = _sgd_step(reference, reference, opt_ref, args)
        got = _sgd_step(step, module, opt, args)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)
        _assert_same_state(module, reference)
    programs = (list(step.programs.values()) if path == "joint"
                else torch_dynamo.compiled_graphs.since(before))
    assert programs
    fallbacks = [dict(p.coverage.fallback) for p in programs if p.coverage.fallback]
    assert not fallbacks, f"training graphs fell back to eager: {fallbacks}"


class _TinyClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, target):
        logits = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return torch.nn.functional.cross_entropy(logits, target)


def _tiny():
    torch.manual_seed(1)
    return _TinyClassifier(), (torch.randn(6, 8), torch.randint(0, 4, (6,)))


def _op_counts(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_loss_elimination_removes_what_only_the_loss_needs():
    """Cross-entropy's gradient is softmax - onehot: the log-probabilities' gather, sum
    and mean exist only for the loss value."""
    module, args = _tiny()
    joint = capture_joint(module, args)
    pruned = eliminate_loss(joint.gm, joint.loss_index)
    before, after = _op_counts(joint.gm), _op_counts(pruned)
    assert before["aten.gather.default"] == 1 and after["aten.gather.default"] == 0
    assert sum(after.values()) < sum(before.values())
    flat = [*[p.detach() for p in module.parameters()], *args]
    full, without = joint.gm(*flat), pruned(*flat)
    assert without[joint.loss_index] is None
    for g, e in zip(without[joint.loss_index + 1:], full[joint.loss_index + 1:]):
        torch.testing.assert_close(g, e)


def test_loss_elimination_on_multilabel_loss():
    """XML-CNN's BCE-with-logits: log1p(exp(-|x|)) is needed by the loss only."""
    bench, module, _ = _pair("xmlcnn")
    joint = capture_joint(module, (*bench.inputs, bench.targets))
    assert _op_counts(joint.gm)["aten.log1p.default"] == 1
    assert _op_counts(eliminate_loss(joint.gm, joint.loss_index))["aten.log1p.default"] == 0


def test_loss_every_computes_the_loss_on_asked_steps_only():
    reference, args = _tiny()
    module = copy.deepcopy(reference)
    step = opweave.compile(module, args, train=True, loss_every=2)
    for i in range(4):
        assert step.wants_loss() == (i % 2 == 0)
        for m in (reference, module):
            m.zero_grad(set_to_none=True)
        expected = reference(*args)
        expected.backward()
        got = step(*args)
        got.backward()
        if i % 2 == 0:
            torch.testing.assert_close(got, expected)
        else:
            assert math.isnan(got.item())
        for p, q in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert set(step.programs) == {True, False}


def test_loss_every_none_never_computes_the_loss():
    module, args = _tiny()
    step = opweave.compile(module, args, train=True, loss_every=None)
    assert math.isnan(step(*args).item())
    assert set(step.programs) == {False}


def test_incoming_gradient_scales_the_precomputed_gradients():
    reference, args = _tiny()
    module = copy.deepcopy(reference)
    (reference(*args) * 3).backward()
    (opweave.compile(module, args, train=True)(*args) * 3).backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _TwoOffsets(torch.nn.Module):
    """Two parameters added as they are: both get the very same gradient node."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5, 3))

    def forward(self, w):
        return ((self.a + self.b) * w).sum()


def test_parameters_sharing_one_gradient_node_are_captured():
    """Found by `opweave fuzz`: aot_export_module refused such a step (it maps gradients
    to parameters by output name), so it ran in eager."""
    reference, x = _TwoOffsets(), torch.randn(5, 3)
    module = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        step = opweave.compile(module, (x,), train=True)
    assert step.graphs
    reference(x).backward()
    step(x).backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _EmptyIndexPut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.empty(1, 0, 1, 8))
        self.register_buffer("index", torch.tensor([3, 1, 4, -2]))

    def forward(self, scale):
        return (torch.index_put(self.x, (self.index,), self.x, accumulate=True) * scale).sum()


def test_index_put_into_an_empty_tensor_trains_like_eager():
    """Found by `opweave fuzz`: its backward reads `grad[index]`, an empty result whose
    indices are out of range; eager reads nothing and checks nothing, opweave's
    index_select checked them and raised."""
    reference, scale = _EmptyIndexPut(), torch.tensor(2.0)
    module = copy.deepcopy(reference)
    step = opweave.compile(module, (scale,), train=True)
    assert step.graphs, step
    step(scale).backward()
    reference(scale).backward()
    assert module.x.grad.shape == reference.x.grad.shape == (1, 0, 1, 8)


def test_second_backward_through_one_call_is_refused():
    module, args = _tiny()
    loss = opweave.compile(module, args, train=True)(*args)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


def test_no_grad_call_returns_the_loss_without_gradients():
    reference, args = _tiny()
    module = copy.deepcopy(reference)
    step = opweave.compile(module, args, train=True)
    with torch.no_grad():
        loss = step(*args)
    torch.testing.assert_close(loss, reference(*args).detach())
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_loss_every_is_validated(bad):
    module, args = _tiny()
    with pytest.raises(ValueError, match="loss_every"):
        opweave.compile(module, args, train=True, loss_every=bad)


def test_model_must_return_a_scalar_loss():
    module = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"scalar loss.*shape \(3, 2\)"):
        opweave.compile(module, (torch.randn(3, 4),), train=True)


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x):
        y = self.fc(x).sum()
        if y.item() > 0:  # data-dependent control flow: no single graph captures it
            return y * 2
        return y


def test_uncapturable_model_trains_in_eager_with_one_warning():
    reference = _DataDependent()
    module = copy.deepcopy(reference)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = opweave.compile(module, (x,), train=True)
        loss = step(x)
        step(x)
    messages = [str(w.message) for w in caught if issubclass(w.category, OpweaveFallbackWarning)]
    assert len(messages) == 1 and "eager" in messages[0]
    loss.backward()
    reference(x).backward()
    torch.testing.assert_close(module.fc.weight.grad, reference.fc.weight.grad)


class _Composites(torch.nn.Module):
    """Layer norm, GELU, softmax, batch norm and cross-entropy in one small model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, target):
        h = self.bn(self.conv(x)).relu().flatten(2)              # [2, 4, 16]
        h = torch.nn.functional.gelu(self.fc(self.ln(h)))
        scores = torch.softmax(h @ h.transpose(1, 2), dim=-1)     # [2, 4, 4]
        logits = (scores @ h).mean(1)                             # [2, 16]
        return torch.nn.functional.cross_entropy(logits, target)


def test_decomposition_splits_backwards_and_keeps_batch_norm_whole():
    """Before: AOTAutograd's composite ops. After: the backwards of layer norm, GELU and
    softmax are primitives, fused into generated kernels (softmax's backward is one
    kernel with its row sum); training batch norm stays one op each way."""
    module = _Composites().train()
    args = (torch.randn(2, 3, 4, 4), torch.tensor([1, 5]))
    joint = capture_joint(copy.deepcopy(module), args)
    ops = _op_counts(joint.gm)
    for composite in ("aten.native_layer_norm_backward.default", "aten.gelu_backward.default",
                      "aten._softmax_backward_data.default"):
        assert ops[composite] == 0, composite
    assert ops["aten.native_batch_norm_backward.default"] == 1
    step = opweave.compile(copy.deepcopy(module), args, train=True)
    step(*args)
    (graph,) = step.graphs
    counts = graph.op_counts()
    assert counts["batch_norm_train"] == 1 and counts["batch_norm_backward"] == 1
    (program,) = step.programs.values()
    (segment,) = [s for s in program.steps if hasattr(s, "executor")]
    kernels = [st for st in segment.executor.lowered_steps if st.kind == "cpp"]
    row_sums = [k for k in kernels if any(n.op == "sum" for n in k.nodes)]
    assert any(len(k.nodes) >= 3 for k in row_sums), "no row sum fused with its neighbours"


def test_switching_to_eval_runs_eager_with_one_warning():
    """The graph is captured in train mode; eval mode (other batch-norm and dropout
    behaviour) must not silently run the train-mode graph."""
    bench, reference, module = _pair("resnet50")
    args = (*bench.inputs, bench.targets)
    step = opweave.compile(module, args, train=True)
    module.eval(), reference.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = step(*args)
        step(*args)
    assert sum(issubclass(w.category, OpweaveFallbackWarning) for w in caught) == 1
    torch.testing.assert_close(got, reference(*args), atol=ATOL, rtol=1e-4)


def test_new_input_shapes_compile_the_step_again():
    """A smaller last batch: the step is captured for its shapes, once, and still exact."""
    reference, (x, y) = _tiny()
    module = copy.deepcopy(reference)
    step = opweave.compile(module, (x, y), train=True)
    for batch in (6, 3, 3):
        xs, ys = x[:batch], y[:batch]
        for m in (reference, module):
            m.zero_grad(set_to_none=True)
        expected = reference(xs, ys)
        expected.backward()
        got = step(xs, ys)
        got.backward()
        torch.testing.assert_close(got, expected)
        for p, q in zip(module.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(step._steps) == 2


def test_inputs_that_require_grad_train_in_eager_with_the_reason():
    reference, (x, y) = _tiny()
    module = copy.deepcopy(reference)
    x = x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = opweave.compile(module, (x, y), train=True)
    assert any("require grad" in str(w.message) for w in caught)
    step(x, y).backward()
    assert x.grad is not None


class _DeepMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256),
                                                              torch.nn.ReLU())
                                          for _ in range(6)])

    def forward(self, x):
        return self.body(x).square().mean()


def test_capture_does_not_compute_the_step():
    """Traced on real inputs, the joint export computed the whole step for real and held
    it: BERT-base at batch 4, sequence 512 peaked 6 GiB above an eager step. On fake
    inputs it allocates less than one activation (4096 x 256 floats, 4 MiB), and the
    compiled step still matches eager."""
    from opweave.bench.memory import peak_allocated_during

    torch.manual_seed(0)
    model, x = _DeepMLP(), torch.randn(4096, 256)
    peak = peak_allocated_during(lambda: capture_joint(model, (x,)))
    assert peak < x.numel() * 4, f"the capture allocated {peak / 2**20:.1f} MiB"
    reference = copy.deepcopy(model)
    step = opweave.compile(model, (x,), train=True)
    step(x).backward()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
