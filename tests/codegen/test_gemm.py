"""Products of two run-time matrices: torch's or oneDNN's GEMM, chosen per layout."""
from __future__ import annotations

import pytest
import torch

from opweave.codegen import gemm, lower
from opweave.ir import Graph, TensorType
from opweave.runtime import Executor

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="needs torch built with oneDNN")
F32 = torch.float32


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(gemm, "_CHOICES", {})


def _product_graph(m=12, k=20, n=16, weight_constant=False, rank=2):
    g = Graph("mm")
    lead = (3,) * (rank - 2)
    a = g.add_input("a", TensorType(lead + (m, k), F32))
    b = (g.add_constant("w", torch.randn(*lead, k, n)) if weight_constant
         else g.add_input("b", TensorType(lead + (k, n), F32)))
    g.outputs = [g.add1("matmul", [a, b])]
    return g


def test_applies_only_to_2d_float_products_of_run_time_values():
    assert gemm.applies(_product_graph().outputs[0].producer)
    assert not gemm.applies(_product_graph(weight_constant=True).outputs[0].producer)
    assert not gemm.applies(_product_graph(rank=3).outputs[0].producer)


@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
def test_every_operand_layout_matches_torch_and_is_measured_once(layout, monkeypatch):
    """Weight gradients read a transposed activation, the forward a transposed weight."""
    m, k, n = 33, 70, 45
    a = torch.randn(k, m).t() if layout[0] == "t" else torch.randn(m, k)
    b = torch.randn(n, k).t() if layout[1] == "t" else torch.randn(k, n)
    torch.testing.assert_close(gemm.measured_matmul(a, b), a @ b, atol=1e-4, rtol=1e-4)
    measured = []
    monkeypatch.setattr(gemm, "_choose", lambda a, b: measured.append(1) or gemm._torch_mm)
    gemm.measured_matmul(a, b)
    assert measured == [] and len(gemm.chosen_forms()) == 1


def test_a_disagreeing_or_failing_onednn_form_is_never_chosen(monkeypatch):
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    monkeypatch.setattr(gemm, "_onednn_mm", lambda a, b: torch.zeros(8, 8))
    assert gemm._choose(a, b) is gemm._torch_mm

    def refuses(a, b):
        raise RuntimeError("unsupported layout")
    monkeypatch.setattr(gemm, "_onednn_mm", refuses)
    assert gemm._choose(a, b) is gemm._torch_mm


def test_lowering_measures_only_when_asked():
    g = _product_graph()
    a, b = torch.randn(12, 20), torch.randn(20, 16)
    measured = lower(g, "ilp", measure=True)
    assert [(s.kind, s.name) for s in measured.steps] == [("library", "matmul (measured GEMM)")]
    torch.testing.assert_close(Executor(g, steps=measured.steps)(a, b)[0], a @ b)
    assert [s.kind for s in lower(g, "ilp", measure=False).steps] == ["op"]
