"""Shorthand shared by the rule modules."""
from __future__ import annotations

import torch

from ..pattern import Const, Var, any_op, op, op_any_arity
from ..rule import Builder, Example, Reject, rule
from ..term import thaw

X, Y, Z = Var("x"), Var("y"), Var("z")
F32 = torch.float32


def ex(*shapes, dtype=F32):
    """An example over random inputs of `shapes`: decorate the function building the lhs."""
    return lambda build: Example(tuple(tuple(s) for s in shapes), build, dtype)


def example(build, *shapes, dtype=F32) -> Example:
    return Example(tuple(tuple(s) for s in shapes), build, dtype)


def rand(*shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    return torch.randn(*shape, generator=g)


# Identity checks look at constants up to this size only: a larger one is a weight, and
# reading it would compute a lazily folded weight the extraction may never keep.
FILLED_CHECK_LIMIT = 1 << 16


def filled_with(b: Builder, cid: int, value) -> bool:
    """Whether class `cid` is a (small) constant whose every element equals `value`."""
    t = b.type(cid)
    if b.constant_name(cid) is None or t.numel > FILLED_CHECK_LIMIT:
        return False
    data = b.value(cid)
    return data.numel() > 0 and bool((data == value).all())


def scalar_of(b: Builder, cid: int):
    """The value of a one-element constant, or Reject."""
    t = b.value(cid)
    if t is None or t.numel() != 1:
        raise Reject("not a scalar constant")
    return t.reshape(()).item()


def require(condition: bool, why: str = "condition") -> None:
    if not condition:
        raise Reject(why)


def same(b: Builder, root: int, new: int) -> int:
    """`new` in place of `root` when their types agree (a broadcast may not change)."""
    require(b.type(root) == b.type(new), "type would change")
    return new


def attrs_of(b_node) -> dict:
    return thaw(b_node.attrs)


__all__ = ["X", "Y", "Z", "F32", "Const", "Var", "any_op", "op", "op_any_arity", "Builder",
           "Example", "Reject", "rule", "ex", "example", "rand", "filled_with", "scalar_of",
           "require", "same", "attrs_of", "torch"]
