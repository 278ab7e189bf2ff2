"""Terms: the IR seen as hash-consed e-nodes over numbered classes.

Rewriting works on terms, not on `ir.Graph` nodes: an `ENode` is an op, its attributes
(frozen, so nodes hash) and its child classes. A class is one value; all e-nodes in a class
compute it. `TermDag` has exactly one e-node per class (an ordinary graph, used by the
backtracking search and the soundness checker); the e-graph (`egraph.py`) has many.

Leaves: graph inputs (`input`, by position), constants (`constant`, data in the
`Store`). A node with several outputs (layer_norm) is a class of tuple type; `get`
projects one output. Random nodes carry a unique `__uid` so two dropouts never merge.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Union

import torch

from ...ir import Graph, TensorType
from ...ir.specialize import graph_symbols
from ... import shared_constants

Attrs = tuple[tuple[str, Any], ...]
ClassType = Union[TensorType, tuple[TensorType, ...]]
LEAF_OPS = frozenset({"input", "constant"})


def freeze(attrs: dict) -> Attrs:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attrs.items()))


def thaw(attrs: Attrs) -> dict:
    """IR attributes back from frozen ones (internal `__` keys dropped)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs if not k.startswith("__")}


@dataclass(frozen=True)
class ENode:
    op: str
    attrs: Attrs
    children: tuple[int, ...] = ()

    def attr(self, key: str):
        for k, v in self.attrs:
            if k == key:
                return v
        raise KeyError(f"{self.op} has no attribute {key!r}")

    def attrs_get(self, key: str, default=None):
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.attrs if not k.startswith("__"))
        return f"{self.op}({', '.join(f'c{c}' for c in self.children)}{'; ' + shown if shown else ''})"


@dataclass
class Store:
    """What one rewrite session knows about every class it ever made: its type, and for
    constants their data. Views (a TermDag, an e-graph snapshot) share one store.

    Folded constants are lazy: the store keeps how to compute one and its type, and
    computes it when something reads its data (`data`). Saturation builds many weight
    variants (merged, scaled) that extraction throws away; only the chosen ones are ever
    computed, which keeps compile-time memory near the model's own size."""

    types: dict[int, ClassType] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # computed data
    constant_types: dict[str, TensorType] = field(default_factory=dict)
    _pending: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    created_by: dict[ENode, str] = field(default_factory=dict)        # e-node -> rule name
    sources: dict[int, str] = field(default_factory=dict)             # class -> IR source text
    # a rule's new node -> the source of the matched node of its op, which says better
    # than its class's where its work comes from (a conv with a batch norm folded in)
    node_sources: dict = field(default_factory=dict)
    first_node: dict[int, ENode] = field(default_factory=dict)        # class -> node it began as
    fold_names: dict[Any, str] = field(default_factory=dict)          # folded term -> constant
    # constant -> (dim, the constants it concatenates along dim): a folded cat of cats is
    # one constant whatever the nesting, and merges can tell weights they already hold
    cat_parts: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    symbolic: bool = False  # some class has symbolic sizes (ir.symbols)
    _ids: Any = field(default_factory=itertools.count)
    _uids: Any = field(default_factory=itertools.count)

    def new_class(self, type_: ClassType, enode: ENode) -> int:
        cid = next(self._ids)
        self.types[cid] = type_
        self.first_node[cid] = enode
        return cid

    def add_constant(self, tensor: torch.Tensor | Callable[[], torch.Tensor], hint: str = "folded",
                     type_: TensorType | None = None) -> ENode:
        """A new constant: a tensor, or a function computing it later (then `type_`)."""
        name, i = hint, 0
        while name in self.constant_types:
            i += 1
            name = f"{hint}_{i}"
        if callable(tensor):
            assert type_ is not None, "a lazy constant needs its type"
            self._pending[name] = tensor
        else:
            tensor = shared_constants.intern(tensor.detach())
            self.constants[name] = tensor
            type_ = TensorType.of(tensor)
        self.constant_types[name] = type_
        return self.constant_node(name)

    def constant_node(self, name: str) -> ENode:
        t = self.constant_types[name]
        return ENode("constant", freeze({"name": name, "shape": list(t.shape), "dtype": t.dtype}))

    def data(self, name: str) -> torch.Tensor:
        """A constant's tensor, computed now if it was lazy."""
        tensor = self.constants.get(name)
        if tensor is None:
            with torch.no_grad():  # folded anew for each plan: plans share one copy
                tensor = shared_constants.intern(self._pending.pop(name)().detach())
            if TensorType.of(tensor) != self.constant_types[name]:
                raise AssertionError(f"constant {name} computed as {TensorType.of(tensor)}, "
                                     f"declared {self.constant_types[name]}")
            self.constants[name] = tensor
        return tensor

    def parts(self, name: str, dim: int) -> tuple[str, ...]:
        """The constants `name` concatenates along `dim` (itself when it is not a cat)."""
        entry = self.cat_parts.get(name)
        return entry[1] if entry and entry[0] == dim else (name,)

    def uid(self) -> int:
        return next(self._uids)


class TermDag:
    """A graph as terms: one e-node per class, hash-consed (equal nodes are one class)."""

    def __init__(self, store: Store):
        self.store = store
        self.node_of: dict[int, ENode] = {}
        self.class_of: dict[ENode, int] = {}
        self.inputs: list[int] = []
        self.roots: list[int] = []

    # -- the view protocol the matcher reads ------------------------------------------------
    def enodes(self, cid: int) -> list[ENode]:
        return [self.node_of[cid]]

    def classes(self) -> Iterable[int]:
        return self.node_of.keys()

    def type(self, cid: int) -> ClassType:
        return self.store.types[cid]

    def constant(self, cid: int) -> torch.Tensor | None:
        name = self.constant_name(cid)
        return None if name is None else self.store.data(name)

    def constant_name(self, cid: int) -> str | None:
        node = self.node_of[cid]
        return node.attr("name") if node.op == "constant" else None

    # -- building ---------------------------------------------------------------------------
    def add(self, enode: ENode, type_: ClassType) -> int:
        cid = self.class_of.get(enode)
        if cid is None:
            cid = self.store.new_class(type_, enode)
            self.node_of[cid] = enode
            self.class_of[enode] = cid
        return cid

    def reachable(self, roots: Iterable[int] | None = None) -> list[int]:
        """Classes reachable from `roots` (default: the outputs), children first."""
        return children_first(self.node_of, self.roots if roots is None else roots)

    def substitute(self, replace: dict[int, int]) -> "TermDag":
        """A new dag in which every use of a class `old` in `replace` reads `replace[old]`
        instead, except inside the replacements themselves (a graph substitution: the
        matched roots are replaced)."""
        news = list(replace.values())
        cone = set(self.reachable(news))
        out = TermDag(self.store)
        out.inputs = list(self.inputs)
        mapped: dict[int, int] = {}
        for cid in self.reachable(news + list(self.roots)):
            node = self.node_of[cid]
            children = tuple(mapped[replace[c]] if c in replace and cid not in cone else mapped[c]
                             for c in node.children)
            mapped[cid] = out._put(ENode(node.op, node.attrs, children), cid)
        out.roots = [mapped[replace.get(r, r)] for r in self.roots]
        return out

    def _put(self, enode: ENode, like: int) -> int:
        """Add `enode`, with the type of class `like`; keep `like`'s id when unchanged."""
        cid = self.class_of.get(enode)
        if cid is not None:
            return cid
        if like not in self.node_of and self.store.first_node.get(like) == enode:
            cid = like
        else:
            cid = self.store.new_class(self.store.types[like], enode)
            if like in self.store.sources:
                self.store.sources.setdefault(cid, self.store.sources[like])
        self.node_of[cid] = enode
        self.class_of[enode] = cid
        return cid


def from_choice(store: Store, choice: dict[int, ENode], roots: list[int],
                inputs: list[int]) -> TermDag:
    """The dag one e-node per class describes (an extraction's result)."""
    dag = TermDag(store)
    dag.inputs = list(inputs)
    dag.roots = list(roots)
    for cid in children_first(choice, roots):
        node = choice[cid]
        dag.node_of[cid] = node
        dag.class_of.setdefault(node, cid)
    return dag


def children_first(choice: Mapping[int, ENode], roots: Iterable[int]) -> list[int]:
    """The classes reachable from `roots` through one chosen e-node per class, each after
    its children (a topological order when the choice is acyclic)."""
    order, seen = [], set()
    stack = [(r, False) for r in reversed(list(roots))]
    while stack:
        cid, done = stack.pop()
        if done:
            order.append(cid)
            continue
        if cid in seen:
            continue
        seen.add(cid)
        stack.append((cid, True))
        stack.extend((c, False) for c in reversed(choice[cid].children) if c not in seen)
    return order


def from_graph(graph: Graph, store: Store | None = None) -> TermDag:
    """The graph's values as classes of a TermDag (roots: the graph outputs)."""
    store = store or Store()
    dag = TermDag(store)
    cls: dict[Any, int] = {}
    store.symbolic = store.symbolic or bool(graph_symbols(graph))
    for i, value in enumerate(graph.inputs):
        cls[value] = dag.add(ENode("input", (("index", i),)), value.type)
        dag.inputs.append(cls[value])
    for node in graph.nodes:
        attrs = dict(node.attrs)
        if node.op == "constant":
            name = attrs["name"]
            store.constants[name] = graph.constants[name]
            store.constant_types[name] = TensorType.of(graph.constants[name])
        if node.opdef.is_random:
            attrs["__uid"] = store.uid()
        children = tuple(cls[v] for v in node.inputs)
        enode = ENode(node.op, freeze(attrs), children)
        store.created_by.setdefault(enode, "")  # an original node: no rule made it
        if len(node.outputs) == 1:
            cls[node.outputs[0]] = cid = dag.add(enode, node.outputs[0].type)
        else:
            cid = dag.add(enode, tuple(v.type for v in node.outputs))
            for i, value in enumerate(node.outputs):
                cls[value] = dag.add(ENode("get", (("index", i),), (cid,)), value.type)
        if node.source:
            store.sources.setdefault(cid, node.source)
    dag.roots = [cls[v] for v in graph.outputs]
    return dag


def _emit_constant(graph: Graph, name: str, data: torch.Tensor, source: str):
    """A constant node; a folded transpose of a weight (a transposed view of contiguous
    storage) becomes a permute of that storage, so no weight is copied."""
    if data.dim() == 2 and not data.is_contiguous() and data.t().is_contiguous():
        stored = graph.add_constant(name, data.t(), source=source)
        return graph.add1("permute", [stored], {"dims": [1, 0]}, source=source)
    return graph.add_constant(name, data, source=source)


def to_graph(choice: dict[int, ENode], roots: list[int], template: Graph, store: Store) -> Graph:
    """Build an IR graph from one chosen e-node per class (reachable from `roots`), with
    the inputs and name of `template`."""
    graph = Graph(template.name)
    values: dict[int, Any] = {}
    inputs = [graph.add_input(v.name, v.type) for v in template.inputs]
    used_constants: dict[str, Any] = {}

    def build(root: int):
        stack = [(root, False)]
        while stack:
            cid, ready = stack.pop()
            if cid in values:
                continue
            node = choice[cid]
            if not ready:
                stack.append((cid, True))
                stack.extend((c, False) for c in node.children if c not in values)
                continue
            values[cid] = emit(cid, node)

    def emit(cid: int, node: ENode):
        if node.op == "input":
            return inputs[node.attr("index")]
        if node.op == "get":
            return values[node.children[0]][node.attr("index")]
        source = store.node_sources.get(node) or store.sources.get(cid, "")
        if node.op == "constant":
            name = node.attr("name")
            if name not in used_constants:
                used_constants[name] = _emit_constant(graph, name, store.data(name), source)
            return used_constants[name]
        outs = graph.add(node.op, [values[c] for c in node.children], thaw(node.attrs),
                         source=source, types=None)
        return outs[0] if len(outs) == 1 else outs

    for root in roots:
        build(root)
    graph.outputs = [values[r] for r in roots]
    return graph
