"""Noticing that weights a compiled plan was built from changed after compiling.

A compiled program reads the model's parameters and buffers as constants. Some steps read
them in place (a torch op over the parameter itself); others read a copy made at compile
time (a weight packed into oneDNN's blocked layout, batch norm folded into a convolution).
An update made after compiling would reach the first kind only, so the result would
depend on which kernels happened to be chosen. Instead every call checks, cheaply,
whether any of them changed, and the caller rebuilds its plan when one did. Both entry
points use this one check: `opweave.compile` (`WeightWatch`) and the Dynamo backend's
frozen inference graphs (`TensorStamp` over the weights it is called with).

Detected exactly: in-place writes autograd sees, which bump PyTorch's version counter
(`with torch.no_grad(): p.copy_(t)`, optimizer steps, `load_state_dict`, `nn.init.*_`);
new storage (`p.data = t`, `model.double()`); a tensor replaced by another object
(`module.weight = nn.Parameter(...)`, `load_state_dict(assign=True)`). Writes through
`p.data` (`p.data.copy_(t)`, `p.data.mul_(d)`) go to a tensor with its own version
counter: they are caught by a one-element fingerprint per tensor (its middle element), so
whole-tensor rewrites are seen and a partial write that leaves that element as it was is
missed. After such a write, `CompiledModel.refresh()` (or `torch._dynamo.reset()`).
"""
from __future__ import annotations

import operator
from typing import Iterable, Sequence

import torch

from ..runtime import native

_version = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


class WeightsChangedWarning(UserWarning):
    """Weights a compiled plan was built from changed after compiling; it was rebuilt."""


class TensorStamp:
    """What a sequence of tensors looked like when a plan was built from them: their
    identity, versions, sizes and strides, storage and a one-element fingerprint each.
    The check runs in the native module once this process has loaded it (CPU tensors)
    and here otherwise; both check the same things. Just after a call (the tensors' data
    and metadata out of the caches), on a 2-core Zen 4: ResNet-50's 318 tensors, their
    lookups in the module's tables included, took 71 us natively (333 us until the
    native check went in passes that prefetch) and about 0.5 us per tensor here."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = tuple(tensors)
        self._native = None
        self._cpu = all(t.device.type == "cpu" for t in self.tensors)
        strided = [t for t in self.tensors if t.layout == torch.strided]
        self._strided_at = [i for i, t in enumerate(self.tensors) if t.layout == torch.strided]
        self.versions = list(map(_version, self.tensors))
        self.layouts = [(t.shape, t.stride()) for t in strided]
        self.pointers = list(map(_data_ptr, strided))  # sparse tensors have no data_ptr
        # on a GPU the fingerprint would synchronize the host with it on every call: there,
        # identity, versions, layouts and storage are checked, and `p.data` writes are not
        self._samples = [s for s in map(_sample_view, strided) if s is not None] if self._cpu else []
        self._fingerprint = torch.cat(self._samples) if self._samples else None

    def matches(self, current: Sequence[torch.Tensor]) -> bool:
        """Whether `current` (the same positions, now) is what the plan was built from."""
        if self._native is None and self._cpu:
            self._native = self._native_stamp()
        if self._native is not None:
            return self._native.matches(current)
        return self._matches_here(current)

    def matches_entries(self, tables: Sequence[dict], keys: Sequence[str],
                        others: Sequence) -> bool:
        """`matches([table.get(key) for table, key in zip(tables, keys)] + others)` for as
        many `keys` as `tables` (a removed entry is a change), the lookups done in the
        native module too where it checks."""
        if self._native is None and self._cpu:
            self._native = self._native_stamp()
        if self._native is not None:
            return self._native.matches_entries(tables, keys, others)
        if len(tables) != len(keys):
            return False
        return self._matches_here(list(map(dict.get, tables, keys)) + list(others))

    def _native_stamp(self):
        """The native form of this stamp, made from the state recorded at construction
        (so a change made in between is still seen), once the module is loaded."""
        module = native.loaded()
        if module is None:
            return None
        stamp = module.Stamp(list(self.tensors))
        if not self._matches_here(self.tensors):
            self._cpu = False  # changed since the stamp was taken: this form keeps deciding
            return None
        return stamp

    def _matches_here(self, current: Sequence[torch.Tensor]) -> bool:
        if not all(map(operator.is_, current, self.tensors)):
            return False
        if list(map(_version, current)) != self.versions:
            return False
        strided = [current[i] for i in self._strided_at]
        if [(t.shape, t.stride()) for t in strided] != self.layouts:
            return False
        if list(map(_data_ptr, strided)) != self.pointers:
            return False
        return self._fingerprint is None or torch.equal(torch.cat(self._samples),
                                                        self._fingerprint)


def _sample_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes of the tensor's middle element, as a view that sees later writes."""
    if tensor.numel() == 0:
        return None
    index = []
    rest = tensor.numel() // 2
    for size in reversed(tensor.shape):
        index.append(rest % size)
        rest //= size
    element = tensor.detach()[tuple(reversed(index))].reshape(1)
    try:
        return element.view(torch.uint8)
    except RuntimeError:  # an element type that has no byte view: the other checks only
        return None


class WeightWatch:
    """The tensors of a module (and any other constants a program read), found again in
    the module's `_parameters`/`_buffers` tables on each check, so a replaced parameter is
    seen as well as a changed one."""

    def __init__(self, model: torch.nn.Module, constants: Iterable = ()):
        self._tables: list[dict] = []  # the module's _parameters or _buffers holding each one
        self._keys: list[str] = []
        owned: list[torch.Tensor] = []
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None:
                        self._tables.append(table)
                        self._keys.append(key)
                        owned.append(tensor)
        seen = {id(t) for t in owned}
        self._others = [t for t in constants if isinstance(t, torch.Tensor) and id(t) not in seen]
        self._stamp = TensorStamp(owned + self._others)

    def changed(self) -> bool:
        return not self._stamp.matches_entries(self._tables, self._keys, self._others)
