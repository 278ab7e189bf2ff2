"""Transformers' key/value caches as pytree nodes, so decoder models can be captured.

A decoder called with `use_cache=True` (the default) builds a `DynamicCache` inside
`forward` and returns it; a decoding step passes it back in as `past_key_values`.
torch.export refuses objects it cannot flatten, in its outputs and its inputs, and
transformers 5.x registers nothing (its `integrations.executorch` helper does, on request,
with a context that cannot be hashed, so a call carrying a cache could not be keyed).

Here a cache flattens to its layers and each layer to its tensors (keys, values, a
sliding-window tensor); every other attribute (class, lengths, flags) is the node's
context, hashable, so the call key tells apart caches of different structure. Unflattening
rebuilds objects of the same classes with the same attributes: a real cache the user can
pass to the next call. Registration happens when opweave compiles a model while
transformers is imported, once; a class someone else registered first is left alone.
"""
from __future__ import annotations

import sys
import threading

import torch
import torch.utils._pytree as pytree

_CACHE_CLASSES = ("DynamicCache",)
_LAYER_CLASSES = ("DynamicLayer", "DynamicSlidingWindowLayer")
_lock = threading.Lock()
_registered: set[type] = set()


def register() -> None:
    """Register transformers' dynamic cache classes with pytree (idempotent; a no-op when
    transformers is not imported: then no model can hold its caches)."""
    if "transformers" not in sys.modules:
        return
    try:
        from transformers import cache_utils as module
    except ImportError:  # a transformers without caches: nothing to register
        return
    with _lock:
        for name in _CACHE_CLASSES + _LAYER_CLASSES:
            cls = getattr(module, name, None)
            if cls is None or cls in _registered:
                continue
            _registered.add(cls)
            if cls in pytree.SUPPORTED_NODES:  # registered elsewhere (the user, transformers)
                continue
            children = "layers" if name in _CACHE_CLASSES else None
            pytree.register_pytree_node(
                cls, _flattener(children), _unflattener(cls),
                flatten_with_keys_fn=_keyed_flattener(children),
                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def _split(obj, children: str | None):
    """(names of the child attributes, the children, the hashable rest of the state)."""
    state = vars(obj)
    if children is not None:
        items = list(state[children])
        names = [(children, i) for i in range(len(items))]
    else:
        names = [(k, None) for k, v in state.items() if isinstance(v, torch.Tensor)]
        items = [state[k] for k, _ in names]
    taken = {k for k, _ in names} | ({children} if children else set())
    rest = tuple(sorted((k, v) for k, v in state.items() if k not in taken))
    return names, items, rest


def _flattener(children):
    def flatten(obj):
        names, items, rest = _split(obj, children)
        return items, (tuple(names), rest)
    return flatten


def _keyed_flattener(children):
    def flatten_with_keys(obj):
        names, items, rest = _split(obj, children)
        keys = [pytree.GetAttrKey(k) if i is None else pytree.SequenceKey(i) for k, i in names]
        return list(zip(keys, items)), (tuple(names), rest)
    return flatten_with_keys


def _unflattener(cls):
    def unflatten(items, context):
        names, rest = context
        obj = cls.__new__(cls)
        state = dict(rest)
        if children_of(cls):
            state[children_of(cls)] = []
        for (name, index), item in zip(names, items):
            if index is None:
                state[name] = item
            else:
                state.setdefault(name, []).append(item)
        vars(obj).update(state)
        return obj
    return unflatten


def children_of(cls) -> str | None:
    return "layers" if cls.__name__ in _CACHE_CLASSES else None


def is_cache(value) -> bool:
    return type(value) in _registered and children_of(type(value)) is not None


def carry_into_inputs(canonical: dict, outputs):
    """In eager PyTorch a decoder updates the cache it was given in place and returns that
    same object. A compiled program returns new tensors: write them into the caller's cache
    and return the caller's object where the output can hold it, so code that keeps using
    its own cache object stays right."""
    given = [v for v in canonical.values() if is_cache(v)]
    if len(given) != 1:
        return outputs
    target = given[0]
    if hasattr(outputs, "keys") and hasattr(outputs, "__setitem__"):  # ModelOutput, dict
        where = [k for k in outputs.keys() if is_cache(outputs[k])]
    elif isinstance(outputs, (tuple, list)):
        where = [i for i, v in enumerate(outputs) if is_cache(v)]
    else:
        return outputs
    if len(where) != 1 or type(outputs[where[0]]) is not type(target):
        return outputs
    state = vars(outputs[where[0]])
    vars(target).clear()
    vars(target).update(state)
    if not isinstance(outputs, tuple):
        outputs[where[0]] = target  # ModelOutput sets the attribute too
    return outputs


def lengths(canonical: dict) -> tuple | None:
    """The shapes of the tensors in the caches a call passes (None: it passes none). A
    program is compiled for static shapes, so a cache of another length is another call."""
    found = [v for v in canonical.values() if is_cache(v)]
    if not found:
        return None
    return tuple(tuple(t.shape) for t in pytree.tree_leaves(found) if isinstance(t, torch.Tensor))
