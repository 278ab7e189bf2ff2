"""Binding a call to a compiled model the way Python binds it to `forward`.

A compiled program takes the tensors of a call as a flat list. Flattening `(args, kwargs)`
as given would bind `c(b=y, a=x)` by the order the keywords were written. So each call is
bound to `forward`'s signature (name -> value, in the signature's order; the call's key
comes from that), then spelled the way the compiled example was spelled (which arguments
positional, which by keyword) before it is flattened. The model itself is never called
with another spelling than its caller used: decorators (transformers' among them) read
some arguments from `**kwargs` and fail when they arrive positionally.

What a flat list of tensors cannot carry - which arguments were given, the containers'
structure, and the Python values torch.export bakes into the graph - forms the key: a call
whose key differs from the compiled one's gets its own program, never another's.
"""
from __future__ import annotations

import inspect
from typing import Any, Hashable

import torch
import torch.utils._pytree as pytree

from ..runtime.executor import InputError

_P = inspect.Parameter


class Binder:
    """Binds calls to `model.forward`'s signature."""

    def __init__(self, model: torch.nn.Module, name: str):
        self.name = name
        try:
            self.signature: inspect.Signature | None = inspect.signature(model.forward)
        except (TypeError, ValueError):  # no introspectable signature: take calls as given
            self.signature = None
        # the common call, positional arguments only, bound without inspect (20 us)
        self._names: list[str] = []
        self._required = 0
        for p in self.signature.parameters.values() if self.signature else ():
            if p.kind not in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
                break
            self._names.append(p.name)
            if p.default is _P.empty:
                self._required = len(self._names)

    def canonical(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call as parameter name -> value, in the signature's order; the same for
        every spelling of the same call. Raises TypeError where Python would."""
        if not kwargs and self._required <= len(args) <= len(self._names):
            return dict(zip(self._names, args))
        if self.signature is None:
            return {"*args": tuple(args), "**kwargs": dict(sorted(kwargs.items()))}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:  # too many positionals, a missing or unknown keyword
            raise TypeError(f"{self.name}.forward{self.signature}: {err}") from None
        params = self.signature.parameters
        return {name: dict(sorted(value.items())) if params[name].kind is _P.VAR_KEYWORD
                else value for name, value in bound.arguments.items()}

    def spelling(self, args: tuple, kwargs: dict) -> "Spelling":
        """How this call spelled its arguments, to spell later calls alike."""
        if self.signature is None:
            return Spelling([("*args", i) for i in range(len(args))],
                            [(k, "**kwargs", k) for k in kwargs])
        params = list(self.signature.parameters.values())
        positional = [p.name for p in params if p.kind in (_P.POSITIONAL_ONLY,
                                                           _P.POSITIONAL_OR_KEYWORD)]
        var_args = next((p.name for p in params if p.kind is _P.VAR_POSITIONAL), None)
        var_kwargs = next((p.name for p in params if p.kind is _P.VAR_KEYWORD), None)
        named = {p.name for p in params if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
        return Spelling([(positional[i], None) if i < len(positional)
                         else (var_args, i - len(positional)) for i in range(len(args))],
                        [(k, k, None) if k in named else (k, var_kwargs, k) for k in kwargs])


class Spelling:
    """Which parameter (and which item of `*args` or `**kwargs`) each positional and each
    keyword argument of a call filled."""

    def __init__(self, positional: list[tuple], keywords: list[tuple]):
        self.positional = positional
        self.keywords = keywords

    def apply(self, canonical: dict[str, Any]) -> tuple[tuple, dict]:
        def value(name, item):
            return canonical[name] if item is None else canonical[name][item]

        return (tuple(value(*where) for where in self.positional),
                {key: value(name, item) for key, name, item in self.keywords})


    def tensors(self, canonical: dict[str, Any]) -> list[torch.Tensor]:
        """The call's tensors in the order of the compiled program's inputs."""
        args, kwargs = self.apply(canonical)
        if is_flat(canonical):
            return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        return tensor_leaves(flatten(args, kwargs)[0])


_SCALARS = (torch.Tensor, int, float, bool, str, type(None))


def is_flat(canonical: dict[str, Any]) -> bool:
    """Whether every argument is a tensor or a scalar (no container to flatten)."""
    return all(isinstance(v, _SCALARS) for v in canonical.values())


def flatten(args: tuple, kwargs: dict) -> tuple[list, pytree.TreeSpec]:
    return pytree.tree_flatten((args, kwargs))


def tensor_leaves(leaves: list) -> list[torch.Tensor]:
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def call_key(canonical: dict[str, Any]) -> Hashable | None:
    """What a compiled program is specialized on: the arguments given, their structure and
    every value that is not a tensor (with its type: 1, 1.0 and True are different
    programs). None when a value cannot be hashed, so no compiled program can be shown
    to fit."""
    if is_flat(canonical):  # the common call, keyed without pytree (30 us)
        return (tuple(canonical),) + tuple(None if isinstance(v, torch.Tensor) else (type(v), v)
                                           for v in canonical.values())
    leaves, spec = pytree.tree_flatten(canonical)
    key = (spec,) + tuple(None if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
                          for leaf in leaves)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def tensor_types(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.device, t.layout) for t in tensors]


def check_tensor_types(name: str, expected: list[tuple], tensors: list[torch.Tensor]) -> None:
    """A compiled program is built for its example's shapes: say which tensor differs."""
    for i, (want, t) in enumerate(zip(expected, tensors)):
        got = (tuple(t.shape), t.dtype, t.device, t.layout)
        if got != want:
            raise InputError(f"{name} was compiled for tensor argument {i} of {_text(want)}, "
                             f"got {_text(got)}; compile it again with an example like this call")


def _text(kind: tuple) -> str:
    shape, dtype, device, layout = kind
    text = f"shape {list(shape)}, {str(dtype).replace('torch.', '')} on {device}"
    return text if layout == torch.strided else f"{text} ({layout})"
