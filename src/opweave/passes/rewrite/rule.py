"""Rules as data: a name, a left-hand pattern, a right-hand builder, examples, a rule set.

A right-hand side is a function `(b: Builder, m: Match) -> class` (or a list of classes,
one per root, for rules with several roots). It builds the replacement through `b.op`,
which infers types and refuses (`Reject`) what the IR would reject, so a rule cannot
build an ill-typed term. It raises `Reject` itself when a side condition fails. The
replacement must have the root's exact type; the engines check that too.

`RULESETS` is the one list of rule sets, with their priorities.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ...ir import ShapeError, TensorType, registry
from .pattern import Match, Pattern
from .term import ClassType, ENode, Store, freeze

# name -> (priority, what the set is for). Equality saturation runs in phases, one per
# priority: phase p saturates with every set of priority <= p, then extracts the best graph,
# which the next phase starts from. Merges come last, so they see weights that the earlier
# phases already folded (a scale folded into Q's weight still merges with K and V).
RULESETS: dict[str, tuple[int, str]] = {
    "fold": (0, "evaluate ops whose inputs are all constants"),
    "simplify": (0, "remove identities: x+0, x*1, reshape to the same shape, ..."),
    "weights": (0, "fold batch norm, scales and biases into conv/matmul weights"),
    "recompose": (0, "recognize decomposed softmax and log-softmax"),
    "layout": (0, "compose and cancel permute/reshape/slice/cat, move views past ops"),
    "algebra": (0, "strength reduction, scales through matmuls, matmul identities"),
    "reduce": (0, "reduction elimination: sums of broadcasts, factors out of sums, sums of sums, column sums through reshapes"),
    "ac": (1, "commutativity, associativity, distributivity: explores orders, grows fast"),
    "merge": (2, "merge parallel matmuls and linear layers that share an input"),
    "merge-conv": (2, "merge parallel convolutions that share an input (IOS); not default"),
}


class Reject(Exception):
    """The right-hand side does not apply to this match (a side condition fails)."""


class Builder:
    """Builds right-hand sides into a sink (a TermDag, or the e-graph's pending nodes)."""

    def __init__(self, view, sink, store: Store, rule_name: str = ""):
        self.view = view
        self.sink = sink
        self.store = store
        self.rule_name = rule_name
        self.source = ""  # where the matched root came from; new nodes inherit it...
        self.sources_by_op: dict[str, str] = {}  # ...or that of a matched node of their op

    def locate(self, match) -> None:
        """New nodes for `match` inherit the source of the matched node of their own op
        (a conv with a batch norm folded in keeps the conv's line, so the profiler puts
        its FLOPs there), else the matched root's."""
        sources = self.store.sources
        self.source = sources.get(match.root, "")
        self.sources_by_op = {n.op: sources[match.classes[k]] for k, n in match.nodes.items()
                              if match.classes.get(k) in sources}

    def op(self, name: str, *inputs: int, **attrs) -> int:
        opdef = registry.get(name)
        if opdef.is_random and self.rule_name:
            raise Reject(f"rules do not create random ops ({name})")
        try:
            full = opdef.full_attrs(attrs)
            types = opdef.infer([self.type(c) for c in inputs], full)
        except (ShapeError, ValueError, TypeError) as err:
            raise Reject(f"{name}: {err}") from None
        if opdef.is_random:  # an example's random op: never merged with another
            full = {**full, "__uid": self.store.uid()}
        enode = ENode(name, freeze(full), tuple(inputs))
        cid = self._add(enode, types[0] if len(types) == 1 else tuple(types))
        own = self.sources_by_op.get(name)
        if own:
            self.store.node_sources.setdefault(enode, own)
        return cid

    def const(self, tensor: torch.Tensor, hint: str = "folded") -> int:
        enode = self.store.add_constant(tensor, hint)
        return self._add(enode, TensorType.of(tensor))

    def get(self, cid: int, index: int) -> int:
        """Output `index` of a node with several outputs."""
        return self._add(ENode("get", freeze({"index": index}), (cid,)), self.type(cid)[index])

    def cached_const(self, key, make: Callable[[], torch.Tensor], hint: str = "folded",
                     type_: TensorType | None = None) -> int:
        """The constant `make()` computes, made once per `key` in this session; computed
        only when read when its type is given (a lazy constant)."""
        name = self.store.fold_names.get(key)
        if name is None:
            enode = self.store.add_constant(make if type_ is not None else make(), hint, type_)
            self.store.fold_names[key] = enode.attr("name")
        else:
            enode = self.store.constant_node(name)
        return self._add(enode, self.store.constant_types[enode.attr("name")])

    def scalar(self, value, dtype: torch.dtype) -> int:
        """A 0-d constant (torch promotes 0-d tensors like scalars)."""
        return self.cached_const(("scalar", repr(value), str(dtype)),
                                 lambda: torch.tensor(value, dtype=dtype),
                                 f"scalar_{str(dtype)[6:]}")

    def constant_name(self, cid: int) -> str | None:
        return self.view.constant_name(cid)

    def type(self, cid: int) -> ClassType:
        return self.store.types[cid]

    def value(self, cid: int) -> torch.Tensor | None:
        return self.view.constant(cid)

    def _add(self, enode: ENode, type_: ClassType) -> int:
        cid = self.sink.add(enode, type_)
        if self.rule_name:
            self.store.created_by.setdefault(enode, self.rule_name)
        if self.source:
            self.store.sources.setdefault(cid, self.source)
        return cid


@dataclass(frozen=True)
class Example:
    """Input shapes (random tensors of `dtype`) and a function that builds the left-hand
    side over them; the soundness test runs the rule on it."""

    shapes: tuple[tuple[int, ...], ...]
    build: Callable[..., int | Sequence[int]]
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Rule:
    name: str
    lhs: Pattern | tuple[Pattern, ...]
    rhs: Callable[[Builder, Match], int | Sequence[int]]
    ruleset: str
    examples: tuple[Example, ...]
    doc: str = ""

    @property
    def priority(self) -> int:
        return RULESETS[self.ruleset][0]

    @property
    def may_be_banned(self) -> bool:
        """Whether the backoff scheduler may ban it for matching too often: every rule but
        constant folding, which matches every e-node (so a graph of a thousand nodes would
        pass any budget) and shrinks what it matches rather than growing the graph."""
        return self.ruleset != "fold"

    def apply(self, b: Builder, m: Match) -> list[int]:
        """The replacement class per root; raises Reject when the rule does not apply or
        the replacement's type differs from the root's."""
        try:
            out = self.rhs(b, m)
        except TypeError as err:
            # a side condition over symbolic sizes that sympy cannot decide (`s0 <= 64`,
            # `range(s0)`, `float(s0)`): the rule does not apply for every size
            if not b.store.symbolic:
                raise
            raise Reject(f"rule {self.name} needs concrete sizes: {err}") from None
        outs = [out] if isinstance(out, int) else list(out)
        if len(outs) != len(m.roots):
            raise AssertionError(f"rule {self.name} built {len(outs)} values for {len(m.roots)} roots")
        for root, new in zip(m.roots, outs):
            if b.type(root) != b.type(new):
                raise Reject(f"rule {self.name} would change {b.type(root)} into {b.type(new)}")
        return outs


RULES: dict[str, Rule] = {}


def rule(name: str, lhs, ruleset: str, examples: Sequence[Example], doc: str = ""):
    """Register the decorated right-hand side as rule `name`."""
    if ruleset not in RULESETS:
        raise ValueError(f"unknown rule set {ruleset!r}")
    if not examples:
        raise ValueError(f"rule {name} needs at least one example (a rule that cannot be "
                         "checked does not ship)")

    def register(rhs):
        if name in RULES:
            raise ValueError(f"rule {name!r} registered twice")
        RULES[name] = Rule(name, lhs, rhs, ruleset, tuple(examples), doc or (rhs.__doc__ or ""))
        return rhs
    return register


def all_rules(rulesets: Sequence[str] | None = None) -> list[Rule]:
    """The registered rules (of `rulesets`, default all), in priority order."""
    from . import rules  # noqa: F401  (registers the rules on import)

    chosen = [r for r in RULES.values() if rulesets is None or r.ruleset in rulesets]
    return sorted(chosen, key=lambda r: r.priority)
