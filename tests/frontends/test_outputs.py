"""A compiled model returns what the model returns, in the same structure, on both
capture paths (torch.export, and make_fx for models export refuses, such as one that
writes to its input); a model that writes to its own buffers runs in eager."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutput

import opweave
from opweave.frontends.program import OpweaveFallbackWarning

STRUCTURES = {
    "tensor": lambda y, z: y,
    "tuple": lambda y, z: (y, z),
    "nested": lambda y, z: (y, (z, [y * 2, {"w": z * 2}])),
    "dict": lambda y, z: {"y": y, "z": z},
    "model_output": lambda y, z: BaseModelOutput(last_hidden_state=y, hidden_states=(z,)),
}


class Returns(torch.nn.Module):
    """A linear layer returning its result in a given structure; `writes_input` makes
    torch.export refuse it (so make_fx captures it)."""

    def __init__(self, structure: str, writes_input: bool):
        super().__init__()
        self.linear = torch.nn.Linear(8, 6)
        self.structure = structure
        self.writes_input = writes_input

    def forward(self, x):
        if self.writes_input:
            x.mul_(2)
        y = self.linear(x)
        return STRUCTURES[self.structure](y, torch.relu(y).sum(-1))


def _assert_same(got, expected):
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(expected)
    assert type(got) is type(expected) and got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("capture", ["export", "make_fx"])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_output_structure_is_the_models(structure, capture, batch):
    model = Returns(structure, writes_input=capture == "make_fx").eval()
    x = torch.randn(batch, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpweaveFallbackWarning)
        compiled = opweave.compile(model, (x.clone(),))
    assert compiled.capture == capture
    x_compiled, x_eager = x.clone(), x.clone()
    with torch.no_grad():
        _assert_same(compiled(x_compiled), model(x_eager))
    torch.testing.assert_close(x_compiled, x_eager)  # the input written as eager writes it


def test_compiling_does_not_write_to_the_example():
    x = torch.randn(2, 8)
    example = x.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpweaveFallbackWarning)
        opweave.compile(Returns("tensor", writes_input=True).eval(), (example,))
    torch.testing.assert_close(example, x)


@pytest.mark.parametrize("batch", [1, 2])
def test_batch_norm_in_training_mode_runs_in_eager_and_updates_its_statistics(batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 3, 8, 8)
    with pytest.warns(OpweaveFallbackWarning, match=r"writes to its buffers.*model\.eval\(\)"):
        compiled = opweave.compile(model, (x,))
    assert compiled.capture == "eager"
    bn, ref_bn = model[1], reference[1]
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)  # compiling wrote nothing
    assert int(bn.num_batches_tracked) == 0
    for step in range(2):
        x = torch.randn(batch, 3, 8, 8) + step
        got, want = compiled(x), reference(x)
        assert got.shape == (batch, 4, 6, 6)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    model.eval()  # in eval mode it compiles
    assert opweave.compile(model, (x,)).capture == "export"


def test_a_buffer_written_where_export_fails_is_refused_and_restored():
    """make_fx runs the model while tracing; a write to a buffer is undone."""

    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.adjacency = torch.eye(4).to_sparse()  # a plain attribute export refuses

        def forward(self, x):
            self.calls.add_(1)
            return torch.sparse.mm(self.adjacency, x)

    model, x = Counter(), torch.randn(4, 3)
    with pytest.warns(OpweaveFallbackWarning, match="writes to its buffers"):
        compiled = opweave.compile(model, (x,))
    assert compiled.capture == "eager" and float(model.calls) == 0
    torch.testing.assert_close(compiled(x), x)
    assert float(model.calls) == 1
