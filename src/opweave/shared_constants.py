"""Constants that compiling derives from a model's weights, shared between plans.

A model compiled for many shapes (a `SymbolicGraph`'s plan per binding, a static program
per call key) derives the same tensors again for every plan: weights folded together by
the rewrite pass (Q, K and V concatenated), transposed for the GEMM layout, packed for
oneDNN. Kept per plan, each new size of BERT-base held another copy of its weights
(measured: 460 MB more per size). Here derived tensors are shared instead:

- `intern(tensor)`: a tensor bit-for-bit equal (dtype, shape, strides, bytes) to one
  interned before whose bytes are still held is replaced by a view of those bytes;
- `derived(kind, sources, params, make)`: a tensor a deterministic `make` computes from
  `sources` (oneDNN's packed weights, whose opaque layout cannot be compared) is computed
  once per kind, sources and params, among the plans compiled in one `sharing` scope (a
  `SymbolicGraph`'s plans: one capture, so one set of weights). A source is known by the
  place of its bytes, not by its contents; outside a scope, a later compile could find a
  pack of weights since rewritten in place, so nothing is shared there.

Entries are weak references: a tensor no plan holds any more is freed as before. Plans
only read their constants, so sharing one tensor between them is safe.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Sequence

import torch

_SAMPLES = 16  # bytes compared before the whole tensor is: equal tensors agree on them
_WORTH = 1024  # elements: smaller tensors are not interned

_lock = threading.Lock()
_scope = threading.local()  # .id: the sharing scope compiles on this thread are in
_scope_ids = itertools.count(1)
made: Counter[str] = Counter()  # derived tensors computed, per kind (the rest were shared)
# key -> [(the storage, weakly: graphs hold their own detached views of it; offset)]
_interned: dict[tuple, list[tuple[weakref.ref, int]]] = {}
# key -> (the sources' storages, held so their bytes cannot be freed and the addresses in
# the key reused while the entry exists; the result, weakly)
_derived: dict[tuple, tuple[tuple, weakref.ref]] = {}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _over(storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor like `like` (contiguous) over `storage` from element `offset`."""
    return torch.empty(0, dtype=like.dtype, device=like.device).set_(
        storage, offset, like.shape, like.stride())


def intern(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a view of the bytes of an interned tensor still held (by any plan, in
    any Python object) with exactly its bytes, type and strides."""
    if (tensor.layout != torch.strided or not tensor.is_contiguous() or tensor.requires_grad
            or tensor.numel() < _WORTH or tensor.reshape(-1).stride(0) != 1
            or tensor.is_complex()):
        return tensor  # small, expanded or not dense: not worth (or not able) to compare
    raw = _raw(tensor)
    step = max(raw.numel() // _SAMPLES, 1)
    key = (tensor.dtype, tuple(tensor.shape), tensor.device,
           bytes(raw[::step][:_SAMPLES].tolist()))
    storage, offset = tensor.untyped_storage(), tensor.storage_offset()
    with _lock:
        if len(_interned) > 4096:  # drop the keys of tensors no plan holds any more
            for dead in [k for k, refs in _interned.items()
                         if all(r() is None for r, _ in refs)]:
                del _interned[dead]
        refs = _interned.setdefault(key, [])
        refs[:] = [(r, o) for r, o in refs if r() is not None]
        for ref, known_offset in refs:
            known = ref()
            if known is None:
                continue
            if known.data_ptr() == storage.data_ptr() and known_offset == offset:
                return tensor  # these very bytes
            twin = _over(known, known_offset, tensor)
            if torch.equal(_raw(twin), raw):
                return twin
        refs.append((weakref.ref(storage), offset))
    return tensor


def new_scope() -> int:
    """A scope id for `sharing`: one per family of plans over the same weights."""
    return next(_scope_ids)


@contextmanager
def sharing(scope: int) -> Iterator[None]:
    """Meanwhile, `derived` on this thread shares results within `scope`."""
    previous = getattr(_scope, "id", None)
    _scope.id = scope
    try:
        yield
    finally:
        _scope.id = previous


def in_scope() -> bool:
    """Whether compiles on this thread share derived constants (a graph compiled for many
    sizes): what packs per plan must not be made then."""
    return getattr(_scope, "id", None) is not None


def derived(kind: str, sources: Sequence[torch.Tensor], params: Hashable,
            make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()`, computed once for the same kind, source tensors and params while the
    result is alive, within the current `sharing` scope (outside one: `make()`). `make`
    must depend on nothing else. A source is known by its bytes' place (storage, offset,
    sizes, strides, dtype), not by its Python object or version counter: each graph holds
    its own views of the same weights. An entry holds its sources' storage, so no other
    data can appear at their place while it exists; and a scope's weights do not change
    (a program whose weights change is rebuilt, with a new SymbolicGraph and scope)."""
    scope = getattr(_scope, "id", None)
    if scope is None:
        return make()
    key = (scope, kind, tuple(_place(s) for s in sources), params)
    with _lock:
        entry = _derived.get(key)
        if entry is not None and entry[1]() is not None:
            return entry[1]()
    value = make()
    made[kind] += 1
    with _lock:
        for stale in [k for k, (_, result) in _derived.items() if result() is None]:
            del _derived[stale]
        _derived[key] = (tuple(s.untyped_storage() for s in sources), weakref.ref(value))
    return value


def _place(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t.device)
