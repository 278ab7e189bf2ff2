"""The e-graph, kept by egglog.

Encoding: every e-node is `(E<k> "op" "attrs-key" child ...)` with k children, and every
class we create is named by an alias e-node `(N id)`; each insertion is
`(union (N id) (E<k> ...))` with children written as their aliases, so a node and its
class enter in one command and egglog's congruence closure merges equal nodes. Attributes
travel as interned keys (`a17`), so any attribute value round-trips exactly.

Python keeps what egglog cannot compute cheaply: each class's type (an e-class analysis:
every e-node of a class has its type) and constant data, in the shared `Store`. Rules are
matched in Python on a `Snapshot` (egglog's serialized e-graph, canonicalized), and their
results go back to egglog as unions; egglog does hash-consing, union-find and rebuilding.
"""
from __future__ import annotations

import json
from collections import defaultdict

import egglog.bindings as egg
import torch

from .term import Attrs, ClassType, ENode, Store

MAX_ARITY = 32  # inputs per node the encoding has constructors for (cat of 32 tensors)
_DECLS = "(datatype Expr (N i64) " + " ".join(
    f"(E{k} String String{' Expr' * k})" for k in range(MAX_ARITY + 1)) + ")"
_BATCH = 64  # commands per egglog call (its parser is slow on very long programs)


class Snapshot:
    """The e-graph at one moment: canonical classes and their e-nodes (the matcher's view).
    A class's canonical id is the smallest alias id in it."""

    def __init__(self, store: Store, members: dict[int, list[ENode]], canon: dict[int, int]):
        self.store = store
        self.members = members
        self._canon = canon
        self.node_count = sum(len(v) for v in members.values())
        self.class_of_node: dict[ENode, int] = {n: c for c, nodes in members.items() for n in nodes}

    def find(self, cid: int) -> int:
        return self._canon.get(cid, cid)

    def enodes(self, cid: int) -> list[ENode]:
        return self.members.get(self.find(cid), [])

    def classes(self):
        return self.members.keys()

    def type(self, cid: int) -> ClassType:
        return self.store.types[cid]

    def constant_name(self, cid: int) -> str | None:
        for node in self.enodes(cid):
            if node.op == "constant":
                return node.attr("name")
        return None

    def constant(self, cid: int) -> torch.Tensor | None:
        name = self.constant_name(cid)
        return None if name is None else self.store.data(name)


class EGraph:
    def __init__(self, store: Store):
        self.store = store
        self._egg = egg.EGraph()
        self._run([_DECLS])
        self._pending: list[str] = []
        self._pending_nodes: dict[ENode, int] = {}
        self._attr_keys: dict[Attrs, str] = {}
        self._attrs: dict[str, Attrs] = {}
        self.snapshot: Snapshot | None = None

    # -- writing ------------------------------------------------------------------------------
    def add(self, enode: ENode, type_: ClassType) -> int:
        """The class of `enode`, inserting it (as a new class) when it is new."""
        snap = self.snapshot
        if snap is not None:
            enode = ENode(enode.op, enode.attrs, tuple(snap.find(c) for c in enode.children))
            known = snap.class_of_node.get(enode)
            if known is not None:
                return known
        cid = self._pending_nodes.get(enode)
        if cid is None:
            cid = self.store.new_class(type_, enode)
            self.insert(cid, enode)
        return cid

    def insert(self, cid: int, enode: ENode) -> None:
        """Put `enode` into the class aliased `cid` (which the store already knows)."""
        if len(enode.children) > MAX_ARITY:
            raise ValueError(f"{enode.op} has {len(enode.children)} inputs; the e-graph "
                             f"encodes at most {MAX_ARITY}")
        self._pending_nodes[enode] = cid
        self._pending.append(f"(union (N {cid}) {self._term(enode)})")

    def union(self, a: int, b: int) -> None:
        self._pending.append(f"(union (N {a}) (N {b}))")

    def flush(self) -> None:
        for i in range(0, len(self._pending), _BATCH):
            self._run(self._pending[i:i + _BATCH])
        self._pending.clear()
        self._pending_nodes.clear()

    def _term(self, enode: ENode) -> str:
        key = self._attr_keys.get(enode.attrs)
        if key is None:
            key = self._attr_keys[enode.attrs] = f"a{len(self._attr_keys)}"
            self._attrs[key] = enode.attrs
        children = "".join(f" (N {c})" for c in enode.children)
        return f'(E{len(enode.children)} "{enode.op}" "{key}"{children})'

    def _run(self, commands: list[str]) -> None:
        self._egg.run_program(*self._egg.parse_program("\n".join(commands)))

    # -- reading ------------------------------------------------------------------------------
    def take_snapshot(self) -> Snapshot:
        """Flush pending unions and read the e-graph back (canonical ids, deduplicated)."""
        self.flush()
        data = json.loads(self._egg.serialize([]).to_json())
        nodes = data["nodes"]
        literal = {nid: n["op"] for nid, n in nodes.items() if n["eclass"].split("-")[0] in ("i64", "String")}
        aliases: dict[str, list[int]] = defaultdict(list)
        for nid, n in nodes.items():
            if n["op"] == "N":
                aliases[n["eclass"]].append(int(literal[n["children"][0]]))
        canon_of_eclass = {ec: min(ids) for ec, ids in aliases.items()}
        canon = {i: canon_of_eclass[ec] for ec, ids in aliases.items() for i in ids}
        members: dict[int, list[ENode]] = defaultdict(list)
        for n in nodes.values():
            if not n["op"].startswith("E") or n["eclass"] not in canon_of_eclass:
                continue
            op_name = json.loads(literal[n["children"][0]])
            attrs = self._attrs[json.loads(literal[n["children"][1]])]
            children = tuple(canon_of_eclass[nodes[c]["eclass"]] for c in n["children"][2:])
            enode = ENode(op_name, attrs, children)
            cls = members[canon_of_eclass[n["eclass"]]]
            if enode not in cls:
                cls.append(enode)
        self.snapshot = Snapshot(self.store, dict(members), canon)
        return self.snapshot
