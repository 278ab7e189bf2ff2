"""`opweave.compile(..., dynamic_shapes=...)`: torch.export's `Dim`s captured as IR
symbols, one capture for every size in their ranges, a static program (one warning) for
sizes outside them, clear errors for a spec torch.export refuses."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.export import Dim

import opweave
from opweave.frontends import torch_export
from opweave.frontends.dynamic_inputs import DynamicInputTypes
from opweave.frontends.torch_export import DynamicShapesError
from opweave.models import build
from opweave.notices import OpweaveFallbackWarning
from opweave.runtime.executor import InputError


@pytest.fixture
def captures(monkeypatch):
    """Counts torch.export / make_fx captures (each one a whole compile)."""
    calls = []
    real = torch_export._compile

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_export, "_compile", counting)
    return calls


def test_bert_with_batch_and_sequence_dims_compiles_once(captures):
    torch.manual_seed(0)
    model = build("bert-base", small=True).module.eval()
    dims = {0: Dim("batch", max=8), 1: Dim("seq", max=64)}
    compiled = opweave.compile(model, (torch.randint(0, 1000, (2, 8)),), dynamic_shapes=(dims,))
    assert compiled.coverage.share == 1.0, compiled.coverage.fallback_message()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)
        with torch.no_grad():
            for batch, seq in [(2, 8), (3, 16), (1, 64), (8, 5), (2, 8)]:
                ids = torch.randint(0, 1000, (batch, seq))
                torch.testing.assert_close(compiled(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-4)
    assert len(captures) == 1
    (family,) = compiled.program.symbolic_graphs
    assert family.compiles == 4  # (2, 8) reused its plan


def test_sizes_outside_the_range_get_a_static_program_with_one_warning(captures):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    compiled = opweave.compile(model.eval(), (torch.randn(4, 6),),
                               dynamic_shapes=({0: Dim("rows", min=2, max=16)},))
    with pytest.warns(OpweaveFallbackWarning, match="axis 0 of tensor argument 0 is 20, outside"):
        x = torch.randn(20, 6)
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled._current.dynamic is None  # the static program ran
    with warnings.catch_warnings():
        warnings.simplefilter("error", OpweaveFallbackWarning)  # said once
        for rows in (20, 1, 20, 9):
            x = torch.randn(rows, 6)
            torch.testing.assert_close(compiled(x), model(x))
    # one dynamic capture, then a static one for 20 and one for 1
    assert [spec is None for spec in captures] == [False, True, True]
    assert compiled._current.dynamic is not None  # 9 is in range again


def test_a_dim_the_model_fixes_is_refused_with_torchs_fix():
    model = build("bert-base", small=True).module.eval()
    ids = torch.randint(0, 1000, (2, 8))
    with pytest.raises(DynamicShapesError, match="Suggested fixes"):
        opweave.compile(model, (ids,), dynamic_shapes=({1: Dim("seq", max=512)},))


def test_another_dtype_is_an_input_error():
    model = torch.nn.Linear(4, 2).eval()
    compiled = opweave.compile(model, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("n")},))
    with pytest.raises(InputError, match=r"tensor argument 0 of shape \[s\d+, 4\], torch.float32"):
        compiled(torch.randn(3, 4, dtype=torch.float64))


def test_dims_shared_between_inputs_must_agree():
    class Add(torch.nn.Module):
        def forward(self, x, y):
            return torch.relu(x + y)

    n = Dim("n")
    compiled = opweave.compile(Add(), (torch.randn(3, 4), torch.randn(3, 4)),
                               dynamic_shapes=({0: n}, {0: n}))
    x, y = torch.randn(7, 4), torch.randn(7, 4)
    torch.testing.assert_close(compiled(x, y), torch.relu(x + y))
    types = compiled._current.dynamic
    assert "the same dim, is 5" in types.misfit("Add", [torch.randn(5, 4), torch.randn(6, 4)])
    assert "size 3 at axis 1, not 4" in types.misfit("Add", [torch.randn(5, 3), torch.randn(5, 3)])
    assert types.misfit("Add", [torch.randn(5, 4), torch.randn(5, 4)]) == ""


def test_dynamic_shapes_refused_for_training():
    with pytest.raises(ValueError, match="dynamic_shapes applies to inference"):
        opweave.compile(torch.nn.Linear(2, 1), (torch.randn(3, 2),), train=True,
                        dynamic_shapes=({0: Dim("n")},))


def test_symbolic_arange_lowers():
    """Position ids built from a symbolic length (`arange(s0)`) stay in opweave."""

    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(32, 4)

        def forward(self, x):
            positions = torch.arange(x.shape[1]) + 1
            return x + self.table(positions)

    model = Positions().eval()
    compiled = opweave.compile(model, (torch.randn(2, 5, 4),),
                               dynamic_shapes=({1: Dim("seq", max=31)},))
    assert compiled.coverage.share == 1.0, compiled.coverage.fallback_message()
    for seq in (3, 17, 31):
        x = torch.randn(2, seq, 4)
        torch.testing.assert_close(compiled(x), model(x))
    assert isinstance(compiled._current.dynamic, DynamicInputTypes)


def test_explain_reports_the_symbols_plans_and_peak():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()).eval()
    report = opweave.explain(model, (torch.randn(4, 6),), graph_breaks=False,
                             dynamic_shapes=({0: Dim("rows", max=64)},))
    text = str(report)
    assert report.share == 1.0
    assert "symbols: s" in text and "= axis 0 of argument 0" in text
    assert "1 plan(s) compiled" in text and "peak before fusion" in text
    assert report.flops > 0  # costed on the example's plan


def test_a_weight_change_recompiled_from_a_call_of_size_one_stays_correct():
    """After a weight change the next call recompiles from its own inputs; a batch of 1
    fixes the dim in torch.export, so that program serves its sizes only, and the
    others get static programs: every output still matches eager."""
    from opweave.frontends.weights import WeightsChangedWarning

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU()).eval()
    compiled = opweave.compile(model, (torch.randn(4, 6),),
                               dynamic_shapes=({0: Dim("rows", max=64)},))
    with torch.no_grad():
        model[0].weight.add_(0.5)
    with pytest.warns(WeightsChangedWarning), \
            pytest.warns(OpweaveFallbackWarning, match="this call's sizes only"):
        x = torch.randn(1, 6)
        torch.testing.assert_close(compiled(x), model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpweaveFallbackWarning)
        for rows in (3, 1, 7):
            x = torch.randn(rows, 6)
            torch.testing.assert_close(compiled(x), model(x))
