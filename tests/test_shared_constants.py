"""Constants derived from weights are shared between plans: interned by their exact bytes,
derived (packed) once per source within a sharing scope, never across scopes."""
from __future__ import annotations

import dataclasses
import gc

import torch

from opweave import shared_constants as shared


def _same_bytes(x, y):
    return x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.dtype == y.dtype


def test_intern_shares_only_bit_identical_tensors():
    a = torch.randn(64, 32)
    assert shared.intern(a) is a
    assert _same_bytes(shared.intern(a.clone()), a)
    assert _same_bytes(shared.intern(a.detach().clone()), a.detach())  # any view holding them
    other = a.clone()
    other[17, 3] += 1e-6
    assert shared.intern(other) is other
    zeros, negative_zeros = torch.zeros(4096), -torch.zeros(4096)
    assert shared.intern(zeros) is zeros
    assert shared.intern(negative_zeros) is negative_zeros  # equal as floats, not as bits
    assert shared.intern(a.to(torch.float64)) is not a
    small = torch.ones(8)
    assert shared.intern(small.clone()) is not shared.intern(small)  # not worth it
    expanded = torch.ones(1).expand(4096)
    assert shared.intern(expanded) is expanded


def test_interned_entries_are_weak():
    a = torch.arange(4096.0)
    shared.intern(a)
    del a
    gc.collect()
    b = torch.arange(4096.0)
    assert shared.intern(b) is b


def test_interned_bytes_are_found_while_any_view_holds_them():
    """A graph stores its own detached view of a constant; the bytes stay shareable
    after the object interned first is gone."""
    a = torch.randn(4096)
    kept = a.detach()
    shared.intern(a)
    del a
    gc.collect()
    assert shared.intern(kept.clone()).data_ptr() == kept.data_ptr()


def test_derived_is_computed_once_per_source_within_a_scope():
    w = torch.randn(16, 8)
    calls = []

    def pack():
        calls.append(1)
        return w.t().contiguous()

    for _ in range(2):
        shared.derived("t", [w], 1, pack)
    assert len(calls) == 2  # outside a scope nothing is shared
    scope = shared.new_scope()
    with shared.sharing(scope):
        first = shared.derived("t", [w], 1, pack)
        assert shared.derived("t", [w.detach()], 1, pack) is first  # another view, same bytes
        assert len(calls) == 3
        shared.derived("t", [w], 2, pack)               # other params
        shared.derived("t", [w[1:]], 1, pack)           # another place in the storage
        assert len(calls) == 5
    w.add_(1)  # changed weights: a program rebuilt from them compiles in a new scope
    with shared.sharing(shared.new_scope()):
        again = shared.derived("t", [w], 1, pack)
    assert len(calls) == 6
    torch.testing.assert_close(again, w.t())


def test_a_dynamic_bert_packs_its_weights_once_for_every_size():
    """The plans a symbolic graph compiles per size share the packed, folded and
    transposed weights; a new size packs nothing."""
    import opweave
    from torch.export import Dim

    from opweave.models import build

    torch.manual_seed(0)
    model = build("bert-base", small=True).module.eval()
    # library forms chosen by the cost model (measuring builds and drops candidate packs),
    # and rewrites bounded by work, not time, so every size folds the same weights
    options = dataclasses.replace(opweave.Options.resolve(None), measure=False,
                                  deterministic=True)
    compiled = opweave.compile(model, (torch.randint(0, 1000, (2, 8)),), options=options,
                               dynamic_shapes=({0: Dim("batch", max=8), 1: Dim("seq", max=64)},))
    with torch.no_grad():
        ids = torch.randint(0, 1000, (2, 8))
        torch.testing.assert_close(compiled(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-4)
        def packs():
            return {k: n for k, n in shared.made.items() if "pack" in k}
        packed = packs()
        assert any(k.startswith("linear-pack") for k in packed), packed
        for batch, seq in [(3, 16), (4, 40)]:
            ids = torch.randint(0, 1000, (batch, seq))
            torch.testing.assert_close(compiled(ids)[0], model(ids)[0], rtol=1e-4, atol=1e-4)
    assert packs() == packed
    (family,) = compiled.program.symbolic_graphs
    assert family.compiles == 3
    first, *others = family.plans
    kept = [v for v in first.graph.constants.values() if v.numel() > 1000]
    for plan in others:
        for name, v in plan.graph.constants.items():
            twins = [k for k in kept if k.shape == v.shape and k.dtype == v.dtype
                     and torch.equal(k, v)]
            if twins:  # a constant another plan holds too is the same bytes in memory
                assert v.data_ptr() == twins[0].data_ptr(), name
