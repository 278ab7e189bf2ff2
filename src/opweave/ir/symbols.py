"""Symbolic dimensions: a size that is not known until the graph is called.

A dimension is an `int` or a sympy integer expression over size symbols (`s0`, `128*s1`).
The symbols are sympy's, declared positive integers, with the names torch's symbolic
shapes (Dynamo, torch.export) give them; the algebra is sympy's, which already reduces
`s0*768/768` to `s0`. A graph is compiled once with its symbols and specialized (every
symbol replaced by its value) for each distinct binding a call brings (`specialize`).

Like torch, a symbol never stands for 0 or 1: a size that is 0 or 1 when captured is a
constant, so a rule may treat a symbol as "not 1" when it broadcasts.
"""
from __future__ import annotations

import math
import re
from typing import Iterable, Mapping, Union

import sympy

Dim = Union[int, sympy.Expr]


class SymbolError(ValueError):
    """A symbolic dimension that cannot be read, or a binding that contradicts one."""


def symbol(name: str) -> sympy.Symbol:
    """The size symbol `name` (a positive integer, as torch declares size symbols)."""
    return sympy.Symbol(name, integer=True, positive=True)


def dim(value) -> Dim:
    """A dimension in its canonical form: an int when it is a number, else the expression
    with its symbols replaced by `symbol`'s (torch's carry other assumptions)."""
    if isinstance(value, bool):
        raise SymbolError(f"a dimension cannot be {value!r}")
    if isinstance(value, int):
        return value
    if hasattr(value, "node") and hasattr(value.node, "expr"):  # a torch.SymInt
        value = value.node.expr
    if not isinstance(value, sympy.Expr):
        raise SymbolError(f"a dimension must be an int or a sympy expression, not {value!r}")
    value = value.xreplace({s: symbol(s.name) for s in value.free_symbols
                            if s != symbol(s.name)})
    if value.is_Integer:
        return int(value)
    if not value.free_symbols:
        raise SymbolError(f"dimension {value} is not an integer")
    return value


def is_symbolic(value) -> bool:
    return isinstance(value, sympy.Expr) and not value.is_Integer


def is_static(shape: Iterable) -> bool:
    return not any(is_symbolic(d) for d in shape)


def free_symbols(values: Iterable) -> set[str]:
    """The names of the symbols in dimensions (or nested lists of them)."""
    names: set[str] = set()
    for v in values:
        if isinstance(v, (list, tuple)):
            names |= free_symbols(v)
        elif is_symbolic(v):
            names |= {s.name for s in v.free_symbols}
    return names


def provably_at_least(a: Dim, b: Dim) -> bool:
    """Whether `a >= b` holds for every value of the symbols (False where undecided)."""
    return bool(sympy.sympify(a - b).is_nonnegative)


def product(dims: Iterable[Dim]) -> Dim:
    dims = list(dims)
    return math.prod(dims) if is_static(dims) else dim(sympy.Mul(*dims))


def to_text(value: Dim) -> str:
    return str(value)


def parse(text: str) -> Dim:
    """A dimension from its text (`to_text`): an int, a symbol or an expression."""
    try:
        expr = sympy.sympify(text, locals={n: symbol(n) for n in _names(text)}, rational=True)
    except (sympy.SympifyError, SyntaxError, TypeError) as err:
        raise SymbolError(f"cannot read dimension {text!r}: {err}") from None
    return dim(expr)


def _names(text: str) -> set[str]:
    """The symbol names in a dimension's text (not functions: `ceiling(s0/2)`)."""
    return set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\b(?!\s*\()", text))


def substitute(value, binding: Mapping[str, int]):
    """`value` (a dimension, or a nested list/tuple of them, or anything else) with every
    symbol replaced by its value in `binding`; a symbol left unbound raises SymbolError."""
    if isinstance(value, list):
        return [substitute(v, binding) for v in value]
    if isinstance(value, tuple):
        return tuple(substitute(v, binding) for v in value)
    if not is_symbolic(value):
        return value
    missing = {s.name for s in value.free_symbols} - set(binding)
    if missing:
        raise SymbolError(f"dimension {value} needs a value for {', '.join(sorted(missing))}")
    result = value.xreplace({symbol(k): sympy.Integer(v) for k, v in binding.items()})
    if not result.is_Integer:
        raise SymbolError(f"dimension {value} is {result} for {dict(binding)}, not an integer")
    return int(result)


def bind(pairs: Iterable[tuple[Dim, int, str]]) -> dict[str, int]:
    """The symbol values that make each declared dimension equal its actual size, from
    `(declared, actual, where)` triples; a SymbolError names the first contradiction.
    A declared dimension that is a plain symbol binds it; an expression is then checked
    (so `2*s0` checks, once `s0` is bound by another input)."""
    pairs = list(pairs)
    binding: dict[str, tuple[int, str]] = {}
    for declared, actual, where in pairs:
        if isinstance(declared, sympy.Symbol):
            seen = binding.get(declared.name)
            if seen is not None and seen[0] != actual:
                raise SymbolError(f"{declared} is {actual} in {where} but {seen[0]} in {seen[1]}")
            binding[declared.name] = (actual, where)
    values = {k: v for k, (v, _) in binding.items()}
    for declared, actual, where in pairs:
        try:
            expected = substitute(declared, values)
        except SymbolError:
            raise SymbolError(f"{where}: size {actual} cannot be matched to {declared} "
                              f"(no input gives {declared} on its own)") from None
        if expected != actual:
            raise SymbolError(f"{where} is {actual}, the graph was compiled for {declared}"
                              + (f" = {expected}" if is_symbolic(declared) else ""))
    return values


def broadcast(*shapes) -> tuple[Dim, ...]:
    """numpy broadcasting over symbolic dimensions: a 1 stretches, equal dimensions stay;
    two different symbolic dimensions are refused (they may or may not be equal)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        sizes = {s[len(s) - rank + axis] for s in shapes if len(s) - rank + axis >= 0}
        sizes.discard(1)
        if len(sizes) > 1:
            raise SymbolError(f"shapes {', '.join(str(list(s)) for s in shapes)} do not "
                              f"broadcast" + ("" if is_static(sizes) else " (or not provably)"))
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)
