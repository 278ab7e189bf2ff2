"""Horizontal fusion (HFTA): each instance of a fused array computes, learns and ends
up exactly as it would alone, compiled or not; what cannot be fused is refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import opweave
from opweave.schedule import ArchitectureMismatch, StackedAdam, StackedSGD, horizontal

from ..conftest import small_model

N = 3


class Net(nn.Module):
    def __init__(self, norm: bool = True):
        super().__init__()
        # no bias before a norm (as in ResNets): its gradient is rounding noise, which
        # Adam scales up to full steps, differently in any two correct programs
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=not norm)
        self.norm = nn.BatchNorm2d(8) if norm else nn.Identity()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


class SummedLoss(nn.Module):
    """The instances' losses summed: each instance's gradient is its own."""

    def __init__(self, array):
        super().__init__()
        self.array = array

    def forward(self, x, y):
        out = self.array(x)
        return sum(nn.functional.cross_entropy(out[i], y[i]) for i in range(out.shape[0]))


def _compile(model, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return opweave.compile(model, inputs, **kwargs)


def test_each_instance_of_a_compiled_array_matches_its_solo_run():
    torch.manual_seed(0)
    solo = [Net().eval() for _ in range(N)]
    for m in solo:  # distinct running statistics too
        m.norm.running_mean.uniform_(-1, 1)
        m.norm.running_var.uniform_(0.5, 2)
    x = torch.randn(N, 2, 3, 8, 8)
    array = horizontal(solo).eval()
    compiled = _compile(array, (x,))
    assert not compiled.coverage.fallback
    got = compiled(x)
    for i, m in enumerate(solo):
        torch.testing.assert_close(got[i], m(x[i]), rtol=1e-5, atol=1e-5)
    assert any(n.op == "conv" and n.attrs.get("groups", 1) == N
               for g in compiled.graphs for n in g.nodes), "convolutions become one grouped conv"


def test_a_benchmark_model_array_matches_its_instances():
    bench = small_model("xmlcnn")
    solo = [copy.deepcopy(bench.module).eval() for _ in range(N)]
    for i, m in enumerate(solo):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * (i + 1) * torch.randn_like(p))
    x = torch.stack([bench.inputs[0]] * N)
    compiled = _compile(horizontal(solo).eval(), (x,))
    got = compiled(x)
    for i, m in enumerate(solo):
        torch.testing.assert_close(got[i], m(bench.inputs[0]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "batchnorm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fused_training_equals_each_instance_trained_alone(norm, optimizer):
    torch.manual_seed(1)
    solo = [Net(norm).train() for _ in range(N)]
    array = horizontal([copy.deepcopy(m) for m in solo]).train()
    x, y = torch.randn(N, 5, 3, 8, 8), torch.randint(0, 4, (N, 5))
    step = _compile(SummedLoss(array), (x, y), train=True)
    lrs = [0.1, 0.05, 0.01]
    if optimizer == "sgd":
        fused = StackedSGD(array.parameters(), lr=lrs, momentum=[0.9, 0.0, 0.5])
        alone = [torch.optim.SGD(m.parameters(), lr=lr, momentum=mom)
                 for m, lr, mom in zip(solo, lrs, [0.9, 0.0, 0.5])]
    else:
        fused = StackedAdam(array.parameters(), lr=lrs, betas=([0.9, 0.8, 0.9], 0.999))
        alone = [torch.optim.Adam(m.parameters(), lr=lr, betas=(b1, 0.999))
                 for m, lr, b1 in zip(solo, lrs, [0.9, 0.8, 0.9])]
    for _ in range(3):
        loss = step(x, y)
        loss.backward()
        fused.step()
        fused.zero_grad()
        losses = []
        for i, (m, opt) in enumerate(zip(solo, alone)):
            solo_loss = nn.functional.cross_entropy(m(x[i]), y[i])
            solo_loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(solo_loss.item())
        assert loss.item() == pytest.approx(sum(losses), rel=1e-5)
    for i, m in enumerate(solo):
        mine, theirs = array.instance(i).state_dict(), m.state_dict()
        for name in theirs:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda text: f"instance {i} {name}: {text}")


def test_shared_inputs_reach_every_instance():
    solo = [nn.Linear(4, 2) for _ in range(N)]
    x = torch.randn(5, 4)
    out = horizontal(solo, shared=[True])(x)
    for i, m in enumerate(solo):
        torch.testing.assert_close(out[i], m(x))


def test_what_cannot_be_fused_is_refused():
    with pytest.raises(ArchitectureMismatch, match="one architecture only"):
        horizontal([nn.Linear(4, 2), nn.Conv1d(4, 2, 1)])
    with pytest.raises(ArchitectureMismatch, match=r"weight is \[3, 4\] torch.float32, model 0's \[2, 4\]"):
        horizontal([nn.Linear(4, 2), nn.Linear(4, 3)])
    with pytest.raises(ArchitectureMismatch, match="training"):
        horizontal([nn.Linear(4, 2).train(), nn.Linear(4, 2).eval()])
    with pytest.raises(ArchitectureMismatch, match="at least one"):
        horizontal([])
    with pytest.raises(ArchitectureMismatch, match=r"stacked per instance, \[2, \.\.\.\]"):
        horizontal([nn.Linear(4, 2), nn.Linear(4, 2)])(torch.randn(3, 4))
    with pytest.raises(ValueError, match="one value or one per instance"):
        StackedSGD(horizontal([nn.Linear(4, 2)] * 2).parameters(), lr=[0.1, 0.2, 0.3])


class WithPositions(nn.Module):
    """A non-persistent buffer (as BERT's position ids): not in a state dict."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.randn(4), persistent=False)

    def forward(self, x):
        return self.fc(x) + self.offset


def test_an_instance_comes_back_whole_with_its_non_persistent_buffers():
    solo = [WithPositions() for _ in range(N)]
    array = horizontal(solo)
    x = torch.randn(2, 4)
    for i, m in enumerate(solo):
        torch.testing.assert_close(array.instance(i)(x), m(x))


def test_the_models_given_are_left_as_they_are():
    solo = [nn.Linear(4, 2) for _ in range(2)]
    before = [copy.deepcopy(m.state_dict()) for m in solo]
    array = horizontal(solo)
    with torch.no_grad():
        for p in array.parameters():
            p.add_(1.0)
    for m, state in zip(solo, before):
        for k, v in m.state_dict().items():
            assert torch.equal(v, state[k])
