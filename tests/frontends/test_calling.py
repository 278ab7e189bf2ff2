"""Calls to a compiled model bind like calls to the model: keywords, defaults, Python
values (which torch.export bakes in: another value compiles another program)."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch

import opweave
from opweave.frontends import torch_export
from opweave.frontends.program import OpweaveFallbackWarning


class Sub(torch.nn.Module):
    def forward(self, a, b):
        return a - 2 * b


class WithDefaults(torch.nn.Module):
    def forward(self, x, bias=None, *, scale: float = 2.0):
        y = x * scale
        return y if bias is None else y + bias


class Scale(torch.nn.Module):
    def forward(self, x, k: float):
        return x * k


class FromDict(torch.nn.Module):
    def forward(self, batch: dict):
        return batch["a"] - 2 * batch["b"]


def _quiet_compile(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpweaveFallbackWarning)
        return opweave.compile(*args, **kwargs)


def test_keywords_bind_by_name_not_by_position():
    a, b = torch.ones(2), torch.zeros(2)
    compiled = _quiet_compile(Sub(), (a, b))
    torch.testing.assert_close(compiled(b=b, a=a), Sub()(a, b))  # [1, 1], not [-2, -2]
    torch.testing.assert_close(compiled(a, b=b), Sub()(a, b))
    torch.testing.assert_close(compiled(b=a, a=b), Sub()(b, a))


def test_calls_python_would_refuse_raise_type_error():
    a, b = torch.ones(2), torch.zeros(2)
    compiled = _quiet_compile(Sub(), (a, b))
    with pytest.raises(TypeError, match="too many positional arguments"):
        compiled(a, b, a)
    with pytest.raises(TypeError, match="missing a required argument: 'b'"):
        compiled(a)
    with pytest.raises(TypeError, match="unexpected keyword argument 'c'"):
        compiled(a, b, c=a)


def test_defaults_and_keyword_only_arguments():
    x, bias = torch.randn(3), torch.randn(3)
    model = WithDefaults()
    compiled = _quiet_compile(model, (x,))
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x, scale=2.0), model(x))
    torch.testing.assert_close(compiled(x, bias), model(x, bias))
    torch.testing.assert_close(compiled(x, scale=3.0), model(x, scale=3.0))
    torch.testing.assert_close(compiled(x, bias, scale=0.5), model(x, bias, scale=0.5))


def _scale_from_kwargs(forward):
    """Like transformers' decorators: reads an argument from **kwargs, so it fails when
    that argument arrives positionally."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs["scale"] = kwargs.get("scale") or 1.0
        return forward(self, *args, **kwargs)

    return wrapper


class Decorated(torch.nn.Module):
    @_scale_from_kwargs
    def forward(self, x, scale=None):
        return x * scale


def test_the_model_is_called_as_its_caller_spelled_the_call():
    x = torch.randn(3)
    model = Decorated()
    compiled = _quiet_compile(model, (x,), example_kwargs={"scale": 2.0})
    assert compiled.capture == "export"
    torch.testing.assert_close(compiled(x, scale=2.0), x * 2.0)
    torch.testing.assert_close(compiled(x=x, scale=3.0), x * 3.0)
    torch.testing.assert_close(compiled(x), x)
    assert compiled.capture == "export"


def test_example_kwargs():
    a, b = torch.randn(2), torch.randn(2)
    compiled = _quiet_compile(Sub(), (), example_kwargs={"b": b, "a": a})
    assert compiled.capture == "export"
    torch.testing.assert_close(compiled(a, b), Sub()(a, b))
    torch.testing.assert_close(compiled(b=a, a=b), Sub()(b, a))


def test_a_python_value_is_not_baked_in():
    x = torch.randn(4)
    compiled = _quiet_compile(Scale(), (x, 2.0))
    torch.testing.assert_close(compiled(x, 5.0), x * 5.0)  # was x * 2
    torch.testing.assert_close(compiled(x, k=2.0), x * 2.0)
    torch.testing.assert_close(compiled(x, 5.0), x * 5.0)
    assert len(compiled._cache) == 2  # 2.0 and 5.0, each compiled once
    assert compiled.capture == "export"
    torch.testing.assert_close(compiled(x, 3), x * 3)  # an int is a value of its own


def test_least_recently_used_programs_are_dropped_with_one_warning(monkeypatch):
    monkeypatch.setattr(torch_export, "MAX_SPECIALIZATIONS", 2)
    x = torch.randn(4)
    compiled = _quiet_compile(Scale(), (x, 1.0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for k in (2.0, 3.0, 4.0, 3.0):
            torch.testing.assert_close(compiled(x, k), x * k)
    assert len(compiled._cache) == 2
    found = [w for w in record if "more than 2 distinct" in str(w.message)]
    assert len(found) == 1


def test_dicts_in_another_key_order_or_with_other_keys_compile_anew():
    a, b, c = torch.randn(2), torch.randn(2), torch.randn(2)
    model = FromDict()
    compiled = _quiet_compile(model, ({"a": a, "b": b},))
    torch.testing.assert_close(compiled({"b": b, "a": a}), model({"a": a, "b": b}))
    torch.testing.assert_close(compiled({"a": b, "b": a}), model({"a": b, "b": a}))
    torch.testing.assert_close(compiled({"c": c, "b": a, "a": b}), model({"a": b, "b": a}))
    with pytest.raises(KeyError), pytest.warns(OpweaveFallbackWarning, match="could not capture"):
        compiled({"a": a})  # what the model itself raises


def test_a_tensor_of_another_shape_or_dtype_is_a_clear_error():
    compiled = _quiet_compile(Sub(), (torch.ones(2), torch.zeros(2)))
    with pytest.raises(ValueError, match=r"tensor argument 1 of shape \[2\], float32 on cpu, "
                                         r"got shape \[3\], float32"):
        compiled(torch.ones(2), torch.zeros(3))
    with pytest.raises(ValueError, match="got shape \\[2\\], float64"):
        compiled(torch.ones(2, dtype=torch.float64), torch.zeros(2))


def test_an_unhashable_value_runs_in_eager():
    class TakesList(torch.nn.Module):
        def forward(self, x, opts):
            return x * opts.factor

    class Opts:
        __hash__ = None
        factor = 3.0

    x = torch.randn(2)
    with pytest.warns(OpweaveFallbackWarning, match="not hashable"):
        compiled = opweave.compile(TakesList(), (x, Opts()))
    torch.testing.assert_close(compiled(x, Opts()), x * 3.0)


class TwoInputs(torch.nn.Module):
    """Reads `b` first, returns one result twice: the plan's inputs and outputs in
    another order than the call's."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, a, b):
        h = torch.relu(self.lin(b * 2.0)) - a
        return h, h.sum(dim=1), h


def _replaying():
    """TwoInputs, its inputs and its compile, called enough for the native plan to be
    recorded, checked and replayed."""
    torch.manual_seed(0)
    model, a, b = TwoInputs().eval(), torch.randn(4, 8), torch.randn(4, 8)
    compiled = _quiet_compile(model, (a, b))
    with torch.no_grad():
        for _ in range(4):
            compiled(a, b)
    return model, a, b, compiled


def test_a_repeated_call_goes_straight_to_the_native_plan(monkeypatch):
    model, a, b, compiled = _replaying()
    assert compiled.program._direct is not None
    assert compiled.program.compiled_graphs[0].executor.native.plan is not None

    def refuse(*_):
        raise AssertionError("a repeated call was bound again")
    monkeypatch.setattr(compiled._binder, "canonical", refuse)
    a2, b2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        got, want = compiled(a2, b2), model(a2, b2)
    assert isinstance(got, tuple) and len(got) == 3 and got[0] is got[2]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_a_repeated_call_of_another_kind_takes_the_checked_path():
    model, a, b, compiled = _replaying()
    with pytest.raises(ValueError, match=r"tensor argument 1 of shape \[4, 8\], float32 on "
                                         r"cpu, got shape \[4, 9\]"):
        compiled(a, torch.randn(4, 9))
    with torch.no_grad():
        for got, want in zip(compiled(a, b=b), model(a, b)):  # a keyword: bound again
            torch.testing.assert_close(got, want)
        strided = torch.randn(8, 4).T  # the plan recorded contiguous inputs: the steps run it
        for got, want in zip(compiled(a, strided), model(a, strided)):
            torch.testing.assert_close(got, want)
        assert compiled._repeat is None  # the plan refused it: the next call is bound
        for got, want in zip(compiled(a, b), model(a, b)):  # and straight again
            torch.testing.assert_close(got, want)
        assert compiled._repeat is not None


def test_profiling_times_the_steps_of_a_program_that_replays():
    model, a, b, compiled = _replaying()
    timed = []

    def wrap(i, call):
        def timed_call(env):
            timed.append(i)
            call(env)
        return timed_call
    with compiled.program.instrumented(wrap), torch.no_grad():
        compiled(a, b)
    assert timed == [0]
    with torch.no_grad():
        compiled(a, b)
    assert timed == [0]  # and no longer afterwards
