"""Patterns over terms and the matcher that finds them in a view (a TermDag or an e-graph).

`op("matmul", X, Const("w"), bind="mm")` matches a class holding a matmul e-node whose
first child is anything (bound to `x`) and whose second child holds a constant (bound to
`w`); the e-node itself is bound as `mm`. A name bound twice must be the same class,
which is how patterns say "the same value" (`op("sub", X, op("amax", X))`). Keyword
attributes are exact constraints; anything else a rule checks in its right-hand side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from .term import LEAF_OPS, ClassType, ENode, freeze


class View(Protocol):
    def enodes(self, cid: int) -> list[ENode]: ...
    def classes(self): ...
    def type(self, cid: int) -> ClassType: ...
    def constant(self, cid: int) -> torch.Tensor | None: ...
    def constant_name(self, cid: int) -> str | None: ...


class Pattern:
    """Base of Var, Const and OpPattern."""


@dataclass(frozen=True)
class Var(Pattern):
    name: str


@dataclass(frozen=True)
class Const(Pattern):
    """A class that holds a constant (its data is known at compile time)."""

    name: str


@dataclass(frozen=True)
class OpPattern(Pattern):
    ops: frozenset[str] | None          # None: any computing op (not a leaf or projection)
    children: tuple[Pattern, ...] | None  # None: any number of children, unmatched
    attrs: tuple = ()
    bind: str | None = None


def op(name: str | Sequence[str], *children: Pattern, bind: str | None = None, **attrs) -> OpPattern:
    ops = frozenset([name] if isinstance(name, str) else name)
    return OpPattern(ops, tuple(children), freeze(attrs), bind)


def any_op(bind: str) -> OpPattern:
    """Any computing op, its children unmatched."""
    return OpPattern(None, None, (), bind)


def op_any_arity(name: str, bind: str) -> OpPattern:
    """One op (a variadic one, such as cat) with any number of children, unmatched."""
    return OpPattern(frozenset([name]), None, (), bind)


@dataclass
class Match:
    """Where a rule's left-hand side matched: its root class(es) and what it bound."""

    roots: list[int]
    classes: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, ENode] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        return self.classes[name]

    @property
    def root(self) -> int:
        return self.roots[0]

    def node(self, name: str) -> ENode:
        return self.nodes[name]


Bindings = tuple[dict, dict]


def _match(view: View, pattern: Pattern, cid: int, b: Bindings) -> Iterator[Bindings]:
    classes, nodes = b
    if isinstance(pattern, (Var, Const)):
        bound = classes.get(pattern.name)
        if bound is not None:
            if bound == cid:
                yield b
            return
        if isinstance(pattern, Const) and view.constant_name(cid) is None:
            return
        yield {**classes, pattern.name: cid}, nodes
        return
    assert isinstance(pattern, OpPattern)
    if pattern.bind is not None and pattern.bind in classes and classes[pattern.bind] != cid:
        return
    for enode in view.enodes(cid):
        if pattern.ops is None:
            if enode.op in LEAF_OPS or enode.op == "get":
                continue
        elif enode.op not in pattern.ops:
            continue
        if pattern.children is not None and len(enode.children) != len(pattern.children):
            continue
        if pattern.attrs and any(enode.attrs_get(k) != v for k, v in pattern.attrs):
            continue
        start = b
        if pattern.bind is not None:
            start = ({**classes, pattern.bind: cid}, {**nodes, pattern.bind: enode})
        if pattern.children is None:
            yield start
            continue
        yield from _match_children(view, pattern.children, enode.children, start)


def _match_children(view, patterns, children, b) -> Iterator[Bindings]:
    if not patterns:
        yield b
        return
    for b1 in _match(view, patterns[0], children[0], b):
        yield from _match_children(view, patterns[1:], children[1:], b1)


def root_ops(pattern: Pattern) -> frozenset[str] | None:
    return pattern.ops if isinstance(pattern, OpPattern) else None


def find(view: View, lhs: Pattern | tuple[Pattern, ...], index: dict[str, list[int]],
         limit: int = 10_000) -> Iterator[Match]:
    """Every match of `lhs` (one pattern, or several sharing names) in `view`.
    `index` maps an op to the classes holding it; at most `limit` matches."""
    patterns = lhs if isinstance(lhs, tuple) else (lhs,)
    candidates = [_candidates(p, index, view) for p in patterns]
    count = 0
    for roots, (classes, nodes) in _join(view, patterns, candidates, [], ({}, {})):
        yield Match(roots, classes, nodes)
        count += 1
        if count >= limit:
            return


def _candidates(pattern: Pattern, index, view) -> list[int]:
    ops = root_ops(pattern)
    if ops is None:
        return list(view.classes())
    seen: dict[int, None] = {}
    for name in sorted(ops):
        for cid in index.get(name, ()):
            seen[cid] = None
    return list(seen)


def _join(view, patterns, candidates, roots, b):
    if not patterns:
        yield roots, b
        return
    for cid in candidates[0]:
        if cid in roots or (roots and cid < roots[-1]):
            continue  # several roots: distinct and in one order (the rules are symmetric)
        for b1 in _match(view, patterns[0], cid, b):
            yield from _join(view, patterns[1:], candidates[1:], roots + [cid], b1)


def build_index(view: View) -> dict[str, list[int]]:
    index: dict[str, list[int]] = {}
    for cid in view.classes():
        for enode in view.enodes(cid):
            index.setdefault(enode.op, []).append(cid)
    return index
