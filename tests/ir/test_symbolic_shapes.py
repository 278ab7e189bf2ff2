"""Shape rules over symbolic dimensions (ir.symbols), for every op in the registry.

Each generated case of `op_cases` is inferred twice: with its concrete input shapes, and
with every input dimension above 1 replaced by a symbol (equal sizes share one, as torch's
duck sizing does). A rule may refuse a symbolic shape (ShapeError: the node then runs in
eager PyTorch), but what it infers must, with the symbols replaced by their values, be
exactly the concrete type. Ops whose rules can carry a symbol must infer at least one case.
"""
from __future__ import annotations

import pytest
import sympy
from hypothesis import given, settings

from opweave.ir import TensorType, registry, symbols
from opweave.ir.registry import ShapeError

from .op_cases import CASES

# Ops whose every generated case needs a concrete size: sparse_mm's sparse operand is a
# constant (GCN's adjacency), and its attributes give that constant's concrete shape.
STATIC_ONLY: set[str] = {"sparse_mm"}
# Ops whose symbolic rule takes an assumption it cannot prove, as the trace's guards did:
# a slice bound (`x[:, :s0]` into a dim of 512, `x[3:]` into one of s0) lies inside its
# dim. Where a binding breaks it, specializing the graph must refuse (SymbolError).
ASSUMING: set[str] = {"slice"}


def _symbolized(shape: tuple[int, ...]) -> tuple:
    return tuple(symbols.symbol(f"s{d}") if d > 1 else d for d in shape)


def _binding(types) -> dict[str, int]:
    return {f"s{d}": d for t in types for d in t.shape if d > 1}


def infer_both(op: str, case):
    opdef = registry.get(op)
    attrs = opdef.full_attrs(case.attrs)
    concrete = [TensorType.of(t) for t in case.inputs]
    expected = opdef.infer(concrete, attrs)
    symbolic = [TensorType(_symbolized(t.shape), t.dtype) for t in concrete]
    try:
        inferred = opdef.infer(symbolic, attrs)
    except ShapeError:
        return expected, None
    try:
        return expected, [t.substitute(_binding(concrete)) for t in inferred]
    except symbols.SymbolError:  # a negative size: an assumption the binding breaks
        return expected, "broken assumption"


def specialize_one(op: str, case):
    """Specialize a one-node graph of the case's symbolic form to its concrete sizes."""
    from opweave.ir import Graph
    from opweave.ir.specialize import specialize

    concrete = [TensorType.of(t) for t in case.inputs]
    g = Graph("one")
    ins = [g.add_input(f"x{i}", TensorType(_symbolized(t.shape), t.dtype))
           for i, t in enumerate(concrete)]
    g.outputs = g.add(op, ins, case.attrs)
    return specialize(g, _binding(concrete))


@pytest.mark.parametrize("op", sorted(CASES))
def test_symbolic_rule_agrees_with_the_concrete_rule(op):
    inferred_any = []

    @settings(max_examples=30, deadline=None, derandomize=True)
    @given(case=CASES[op])
    def check(case):
        expected, got = infer_both(op, case)
        if got is None:
            return
        if got != expected:
            assert op in ASSUMING, (case, got, expected)
            with pytest.raises(symbols.SymbolError):
                specialize_one(op, case)
        inferred_any.append(case)

    check()
    if op not in STATIC_ONLY:
        assert inferred_any, f"{op}: no case inferred with symbolic sizes"


def _symbolic_graph():
    import torch

    from opweave.ir import Graph

    s0, s1 = symbols.symbol("s0"), symbols.symbol("s1")
    g = Graph("g")
    x = g.add_input("x", TensorType((s0, s1, 8), torch.float32))
    y = g.add1("matmul", [x, g.add_constant("w", torch.randn(8, 4))])
    flat = g.add1("reshape", [y], {"shape": [s0 * s1, 4]})
    g.outputs = [g.add1("softmax", [flat], {"dim": -1})]
    return g


def test_a_symbolic_graph_round_trips_through_text_and_json():
    from opweave.ir import parse_graph, print_graph, verify
    from opweave.ir.serialize import from_json, to_json

    g = verify(_symbolic_graph())
    text = print_graph(g)
    assert '%reshape: f32[?"s0*s1",4]' in text and "(%x: f32[s0,s1,8])" in text
    assert print_graph(verify(parse_graph(text, g.constants))) == text
    assert print_graph(verify(from_json(to_json(g), g.constants))) == text


def test_specialize_substitutes_every_symbol_and_binding_names_a_mismatch():
    import torch

    from opweave.ir.specialize import binding_of, specialize
    from opweave.runtime import Executor

    g = _symbolic_graph()
    binding = binding_of(g, [(2, 3, 8)])
    assert binding == {"s0": 2, "s1": 3}
    concrete = specialize(g, binding)
    assert [v.type.shape for v in concrete.outputs] == [(6, 4)]
    x = torch.randn(2, 3, 8)
    expected = torch.softmax((x @ g.constants["w"]).reshape(6, 4), -1)
    torch.testing.assert_close(Executor(concrete)(x)[0], expected)
    with pytest.raises(symbols.SymbolError, match="input %x dim 2 is 7, the graph was compiled for 8"):
        binding_of(g, [(2, 3, 7)])
    with pytest.raises(symbols.SymbolError, match="rank 2"):
        binding_of(g, [(2, 3)])


def test_the_verifier_refuses_a_symbol_no_input_carries():
    import torch

    from opweave.ir import Graph, VerificationError, verify

    g = Graph("g")
    x = g.add_input("x", TensorType((6,), torch.float32))
    g.outputs = [g.add1("expand", [x], {"shape": [symbols.symbol("s9"), 6]})]
    with pytest.raises(VerificationError, match="symbol.* s9 appear in no input's shape"):
        verify(g)


def test_symbolic_broadcasting_refuses_two_different_symbols():
    a, b = symbols.symbol("a"), symbols.symbol("b")
    assert symbols.broadcast((a, 1), (1, 4)) == (a, 4)
    assert symbols.broadcast((a,), (a,)) == (a,)
    with pytest.raises(symbols.SymbolError, match="not provably"):
        symbols.broadcast((a,), (b,))


def test_dimension_text_parses_back_and_rejects_non_integers():
    s0 = symbols.symbol("s0")
    assert symbols.parse("128*s0") == 128 * s0
    assert symbols.parse("7") == 7
    assert symbols.dim(sympy.Integer(5)) == 5 and isinstance(symbols.dim(sympy.Integer(5)), int)
    with pytest.raises(symbols.SymbolError):
        symbols.parse("s0 +")


@pytest.mark.parametrize("start, step", [(0, 1), (3, 2), (1, 3)])
def test_arange_to_a_symbol_has_the_length_torch_gives(start, step):
    """`arange(start, s0 + 5, step)`: a length over symbols that specializes (text and JSON
    forms included) to exactly torch's arange at every size."""
    import torch

    from opweave.ir import Graph, parse_graph, print_graph, verify
    from opweave.ir.serialize import from_json, to_json
    from opweave.ir.specialize import specialize
    from opweave.runtime import Executor

    s0 = symbols.symbol("s0")
    g = Graph("positions")
    x = g.add_input("x", TensorType((s0,), torch.int64))
    r = g.add1("arange", [], {"start": start, "end": s0 + 5, "step": step, "dtype": torch.int64})
    g.outputs = [g.add1("add", [r, r])]
    verify(g)
    text = print_graph(g)
    assert print_graph(verify(parse_graph(text, g.constants))) == text
    assert print_graph(verify(from_json(to_json(g), g.constants))) == text
    for n in (1, 2, 7, 10):
        (out,) = Executor(specialize(g, {"s0": n}))(torch.zeros(n, dtype=torch.int64))
        torch.testing.assert_close(out, 2 * torch.arange(start, n + 5, step))


def test_symbolic_peak_equals_the_concrete_plans_peak_at_every_binding():
    """The peak formula over the symbols, evaluated at a binding, is exactly the memory
    plan's peak of the graph specialized to it."""
    import torch

    from opweave.ir import Graph
    from opweave.ir.specialize import specialize
    from opweave.runtime.memory_plan import plan_memory, symbolic_peak

    s0, s1 = symbols.symbol("s0"), symbols.symbol("s1")
    g = Graph("attention_like")
    x = g.add_input("x", TensorType((s0, s1, 8), torch.float32))
    scores = g.add1("matmul", [x, g.add1("permute", [x], {"dims": [0, 2, 1]})])  # [s0,s1,s1]
    weights = g.add1("softmax", [scores], {"dim": -1})
    mixed = g.add1("matmul", [weights, x])                                       # [s0,s1,8]
    flat = g.add1("reshape", [mixed], {"shape": [s0 * s1, 8]})
    g.outputs = [g.add1("relu", [flat])]
    peak = symbolic_peak(g)
    assert symbols.free_symbols([peak]) == {"s0", "s1"}
    for binding in ({"s0": 1, "s1": 2}, {"s0": 3, "s1": 16}, {"s0": 2, "s1": 500}):
        concrete = plan_memory(specialize(g, binding)).unplanned_peak_bytes
        assert symbols.substitute(peak, binding) == concrete
