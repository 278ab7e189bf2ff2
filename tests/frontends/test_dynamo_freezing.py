"""Inference freezing under `torch.compile(backend="opweave")`: weights become constants
(batch norm folded), a weight changed after compiling is never served stale, and training
with grad enabled goes through AOTAutograd's forward and backward graphs as before."""
from __future__ import annotations

import warnings

import pytest
import torch

from opweave.frontends import freezing, torch_dynamo
from opweave.frontends.freezing import WeightsChangedWarning


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _model(seed=0) -> ConvNet:
    torch.manual_seed(seed)
    model = ConvNet().eval()
    with torch.no_grad():  # batch statistics that are not the identity
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.uniform_(0.5, 1.5)
    return model


X = torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1))


def _run(compiled, model, ctx=torch.no_grad):
    with ctx():
        got, expected = compiled(X), model(X)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _op_names(program) -> list[str]:
    return [node.op for graph in program.graphs for node in graph.nodes]


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode],
                         ids=["no_grad", "inference_mode"])
def test_no_grad_freezes_weights_and_folds_batch_norm(ctx):
    model = _model()
    before = torch_dynamo.frozen_programs.mark()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model, ctx)
    frozen = torch_dynamo.frozen_programs.since(before)
    assert len(frozen) == 1 and frozen[0].frozen
    program = frozen[0].program
    # every parameter and buffer is a constant; the image is the only runtime input
    # (eval-mode batch norm reads running_mean and running_var, not num_batches_tracked)
    assert len(frozen[0].positions) == len(list(model.parameters())) + 2
    assert [n.name for n in program.placeholders] == ["arg2_1"]
    ops = _op_names(program)
    assert "batch_norm" not in ops and "conv" in ops and "constant" in ops


def test_nothing_requiring_grad_freezes_too():
    model = _model().requires_grad_(False)
    before = torch_dynamo.frozen_programs.mark()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model, ctx=torch.enable_grad)
    assert len(torch_dynamo.frozen_programs.since(before)) == 1


def test_freeze_option_off_keeps_weights_as_inputs():
    model = _model()
    before = torch_dynamo.frozen_programs.mark(), torch_dynamo.compiled_graphs.mark()
    _run(torch.compile(model, backend="opweave", options={"freeze": False}), model)
    assert not torch_dynamo.frozen_programs.since(before[0])
    program = torch_dynamo.compiled_graphs.since(before[1])[-1]
    assert len(program.placeholders) == len(model.state_dict())  # weights are inputs


def _set_data_copy(model, new):
    model.conv.weight.data.copy_(new.conv.weight)  # through .data: caught by the fingerprint


def _no_grad_copy(model, new):
    with torch.no_grad():
        model.bn.weight.copy_(new.bn.weight)


def _load_state_dict(model, new):
    model.load_state_dict(new.state_dict())


def _load_state_dict_assign(model, new):
    model.load_state_dict(new.state_dict(), assign=True)


def _replace_data(model, new):
    model.conv.weight.data = new.conv.weight.detach().clone()


def _new_parameter(model, new):
    model.fc.bias = torch.nn.Parameter(new.fc.bias.detach().clone())


def _running_stat(model, new):
    model.bn.running_var.data.mul_(3.0)  # through .data: caught by the fingerprint


def _optimizer_step(model, new):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(X).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


UPDATES = [_set_data_copy, _no_grad_copy, _load_state_dict, _load_state_dict_assign,
           _replace_data, _new_parameter, _running_stat, _optimizer_step]


@pytest.mark.parametrize("update", UPDATES, ids=lambda f: f.__name__.strip("_"))
def test_weight_update_rebuilds_the_frozen_plan(update, monkeypatch):
    monkeypatch.setattr(freezing, "MIN_CALLS_PER_PLAN", 0)  # always rebuild, never unfreeze
    model, new = _model(0), _model(1)
    before = torch_dynamo.frozen_programs.mark()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model)
    frozen = torch_dynamo.frozen_programs.since(before)[0]
    for round_ in range(2):
        update(model, new)
        new = _model(2 + round_)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run(compiled, model)  # never the stale result
        assert frozen.rebuilds == round_ + 1 and frozen.frozen
        warned = [w for w in caught if issubclass(w.category, WeightsChangedWarning)]
        assert len(warned) == (1 if round_ == 0 else 0)  # once per program
        _run(compiled, model)
        assert frozen.rebuilds == round_ + 1  # an unchanged model is not rebuilt


def test_weights_changing_every_call_stop_being_frozen():
    model, new = _model(0), _model(1)
    before = torch_dynamo.frozen_programs.mark()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model)
    frozen = torch_dynamo.frozen_programs.since(before)[0]
    with pytest.warns(WeightsChangedWarning, match="rebuilt"):
        _load_state_dict(model, new)
        _run(compiled, model)
    with pytest.warns(WeightsChangedWarning, match="reads them as inputs"):
        _load_state_dict(model, _model(2))
        _run(compiled, model)
    assert not frozen.frozen and frozen.rebuilds == 1
    for seed in (3, 4):  # from now on the weights are read at every call
        _load_state_dict(model, _model(seed))
        _run(compiled, model)
    assert frozen.rebuilds == 1


def test_a_partial_write_through_data_that_misses_the_fingerprint_is_not_detected():
    """The documented limit: `.data` writes bypass the version counter, and the one-element
    fingerprint does not see a write elsewhere in the tensor. Pinned so that a torch that
    starts counting these writes (or a better check) shows up here."""
    model = _model()
    before = torch_dynamo.frozen_programs.mark()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model)
    model.bn.weight.data[0] += 1.0  # the fingerprint reads element 4; bn is folded into conv
    with torch.no_grad():
        stale = compiled(X)
    assert torch_dynamo.frozen_programs.since(before)[0].rebuilds == 0
    assert not torch.allclose(stale, model(X))


def test_grad_enabled_trains_through_forward_and_backward_graphs():
    model, reference = _model(), _model()
    compiled = torch.compile(model, backend="opweave")
    _run(compiled, model)  # an inference graph first: grad mode is guarded, so
    before = torch_dynamo.frozen_programs.mark()  # this call recompiles for training
    loss = compiled(X).square().sum()
    loss.backward()
    reference(X).square().sum().backward()
    assert not torch_dynamo.frozen_programs.since(before)
    for got, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=1e-4)
