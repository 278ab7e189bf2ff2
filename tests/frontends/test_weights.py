"""Weights changed after compiling reach every step of the compiled model, or none: the
next call notices the change and recompiles, whichever kernels were chosen."""
from __future__ import annotations

import warnings

import pytest
import torch

import opweave
from opweave.codegen import choice
from opweave.frontends.weights import WeightsChangedWarning


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 8)).eval()


def _no_grad_copy(model):
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(32, 16))


def _load_state_dict(model):
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})


def _optimizer_step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()


def _new_storage(model):
    model[2].bias.data = torch.randn(8)


def _new_parameter(model):
    model[0].weight = torch.nn.Parameter(torch.randn(32, 16))


UPDATES = [_no_grad_copy, _load_state_dict, _optimizer_step, _new_storage, _new_parameter]


@pytest.fixture(params=["onednn", "reference"])
def kernel(request, monkeypatch):
    """Force the packed oneDNN form or the torch-op form of each linear layer (a measured
    choice otherwise), so both are tested whatever this machine measures."""
    real = choice.choose

    def forced(key, candidates, inputs, rounds=7, work=0.0):
        name = request.param if request.param in candidates else "reference"
        return name, real(key, {name: candidates[name]}, inputs, rounds=1, work=work)[1]

    monkeypatch.setattr(choice, "choose", forced)
    monkeypatch.setattr(choice, "_CHOICES", {})
    return request.param


@pytest.mark.parametrize("update", UPDATES, ids=lambda f: f.__name__.strip("_"))
def test_an_update_after_compiling_is_seen_by_every_step(update, kernel):
    model, x = _model(), torch.randn(4, 16)
    compiled = opweave.compile(model, (x,), fusion="ilp")
    kinds = {s.kind for g in compiled.program.steps if hasattr(g, "executor")
             for s in g.executor.lowered.steps}
    assert ("library" if kernel == "onednn" else "reference") in kinds
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    update(model)
    with torch.no_grad(), pytest.warns(WeightsChangedWarning, match="weights of Sequential changed"):
        torch.testing.assert_close(compiled(x), model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightsChangedWarning)  # recompiled once, not every call
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))
        update(model)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x))  # warned once per compiled model


@pytest.mark.parametrize("update", UPDATES, ids=lambda f: f.__name__.strip("_"))
def test_an_update_between_replayed_calls_is_seen(update):
    """Calls that go straight to the native plan (`CompiledModel._replay`) check the
    weights too."""
    model, x = _model(), torch.randn(4, 16)
    compiled = opweave.compile(model, (x,))
    with torch.no_grad():
        for _ in range(4):
            compiled(x)
    assert compiled._repeat is not None
    assert compiled.program.compiled_graphs[0].executor.native.plan is not None
    update(model)
    with torch.no_grad(), pytest.warns(WeightsChangedWarning, match="weights of Sequential changed"):
        torch.testing.assert_close(compiled(x), model(x))


def test_whole_tensor_writes_through_data_are_seen():
    """`p.data` has a version counter of its own; the one-element fingerprint still sees a
    write that changes the whole tensor."""
    model, x = _model(), torch.randn(4, 16)
    compiled = opweave.compile(model, (x,))
    model[0].weight.data.mul_(2)
    with torch.no_grad(), pytest.warns(WeightsChangedWarning):
        torch.testing.assert_close(compiled(x), model(x))


def test_partial_writes_through_data_need_a_refresh():
    """A write through `p.data` that leaves the fingerprinted (middle) element as it was is
    not seen without reading every weight; `refresh()` recompiles against it."""
    model, x = _model(), torch.randn(4, 16)
    compiled = opweave.compile(model, (x,))
    model[0].weight.data[0].mul_(2)  # row 0: not the middle element
    compiled.refresh()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))


# -- the stamp itself, in both of its forms ------------------------------------------------

@pytest.fixture(params=["native", "python"])
def stamp_form(request, monkeypatch):
    """TensorStamp checks in the native module once it is loaded, in Python before: both
    forms must see the same changes."""
    from opweave.runtime import native
    if request.param == "native":
        if native.module(wait=True) is None:
            pytest.skip(f"native module unavailable: {native.unavailable()}")
    else:
        monkeypatch.setattr(native, "loaded", lambda: None)
    return request.param


def _tensors():
    torch.manual_seed(0)
    sparse = torch.eye(4).to_sparse()
    return [torch.randn(8, 6), torch.randn(6, 8).t(), torch.randn(0, 3), sparse,
            torch.arange(10), torch.nn.Parameter(torch.randn(5)), torch.randn(9, 4)[2:7, ::2]]


def _write_middle_element_only(t):
    """Change only the element the stamp samples (numel // 2 in row-major order)."""
    flat_index, index = t.numel() // 2, []
    for size in reversed(t.shape):
        index.append(flat_index % size)
        flat_index //= size
    t.data[tuple(reversed(index))] += 1


CHANGES = {
    "versioned write": lambda ts: ts[0].add_(1),
    "write to a transposed view's sampled element only": lambda ts: _write_middle_element_only(ts[1]),
    "write to a sliced tensor's sampled element only": lambda ts: _write_middle_element_only(ts[6]),
    "same storage, transposed": lambda ts: setattr(ts[1], "data", ts[1].data.t()),
    "same storage, other shape": lambda ts: setattr(ts[0], "data", ts[0].data.view(6, 8)),
    "write through .data": lambda ts: ts[4].data.add_(1),
    "new storage": lambda ts: setattr(ts[5], "data", torch.randn(5)),
    "sparse tensor changed": lambda ts: ts[3].mul_(2),
}


@pytest.mark.parametrize("change", CHANGES, ids=str)
def test_the_stamp_sees_each_change(stamp_form, change):
    tensors = _tensors()
    from opweave.frontends.weights import TensorStamp
    stamp = TensorStamp(tensors)
    assert stamp.matches(tensors) and stamp.matches(tuple(tensors))
    assert (stamp._native is not None) == (stamp_form == "native")
    CHANGES[change](tensors)
    assert not stamp.matches(tensors)


def test_the_stamp_sees_other_objects_and_other_lengths(stamp_form):
    from opweave.frontends.weights import TensorStamp
    tensors = _tensors()
    stamp = TensorStamp(tensors)
    assert not stamp.matches(tensors[:-1])
    assert not stamp.matches(tensors[:-1] + [torch.nn.Parameter(tensors[-1].detach().clone())])
    assert not stamp.matches(tensors[:-1] + [None])  # a parameter set to None


def test_the_stamp_finds_the_tensors_in_their_tables(stamp_form):
    """`matches_entries`, WeightWatch's check: the tensors looked up in a module's tables
    (a replaced or removed entry is a change), then the others, then `matches` on them."""
    from opweave.frontends.weights import TensorStamp
    tensors = _tensors()
    first, second = {"a": tensors[0], "b": tensors[1]}, {"c": tensors[2], "d": tensors[3],
                                                          "e": tensors[4]}
    tables, keys = [first, first, second, second, second], ["a", "b", "c", "d", "e"]
    others = tensors[5:]
    stamp = TensorStamp(tensors)

    def matches():
        return stamp.matches_entries(tables, keys, others)
    assert matches()
    assert (stamp._native is not None) == (stamp_form == "native")
    second["d"] = torch.nn.Parameter(torch.randn(4, 4))  # replaced
    assert not matches()
    second["d"] = tensors[3]
    del first["b"]                                        # removed
    assert not matches()
    first["b"] = tensors[1]
    assert matches()
    assert stamp.matches_entries(tuple(tables), tuple(keys), tuple(others))
    assert not stamp.matches_entries(tables, keys, others[:-1])
    assert not stamp.matches_entries(tables, keys[:-1], others)
    assert not stamp.matches_entries(tables, keys, others[:-1] + [torch.randn(5, 2)])
    assert not stamp.matches_entries(tables, keys, others[:-1] + [None])
    tensors[6].data.mul_(3)                               # written through .data
    assert not matches()


def test_a_change_before_the_native_form_exists_is_still_seen(monkeypatch):
    """The native form is made at the first check after the module loads, from the tensors
    as they are then: a change made before that must not become the new reference."""
    from opweave.frontends.weights import TensorStamp
    from opweave.runtime import native
    if native.module(wait=True) is None:
        pytest.skip(f"native module unavailable: {native.unavailable()}")
    tensors = _tensors()
    with monkeypatch.context() as m:
        m.setattr(native, "loaded", lambda: None)
        stamp = TensorStamp(tensors)
    tensors[4].data.add_(1)
    assert not stamp.matches(tensors)
    assert not stamp.matches(tensors)
