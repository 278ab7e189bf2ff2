"""Algebra: commutativity, associativity, distributivity, matmul identities, strength
reduction. Rules that reassociate floating-point arithmetic hold within rounding."""
from __future__ import annotations

import math

from ._helpers import (F32, Const, X, Y, Z, example, filled_with, op, rand, require, rule, same,
                       scalar_of)


def _commutative(name: str):
    @rule(f"{name}-commute", op(name, X, Y), "ac",
          [example(lambda b, x, y: b.op(name, x, y), (2, 3), (3,))], f"{name}(x, y) = {name}(y, x)")
    def rhs(b, m):
        return b.op(name, m["y"], m["x"])
    return rhs


for _name in ("add", "mul", "maximum", "minimum"):
    _commutative(_name)


def _same_dtype(b, *cids) -> None:
    require(len({b.type(c).dtype for c in cids}) == 1, "mixed dtypes")


def _associative(name: str):
    @rule(f"{name}-associate", op(name, op(name, X, Y), Z), "ac",
          [example(lambda b, x, y, z: b.op(name, b.op(name, x, y), z), (2, 3), (3,), (2, 3))],
          f"({name}(x, y), z) = {name}(x, {name}(y, z))")
    def rhs(b, m):
        _same_dtype(b, m["x"], m["y"], m["z"])
        return same(b, m.root, b.op(name, m["x"], b.op(name, m["y"], m["z"])))
    return rhs


for _name in ("add", "mul"):
    _associative(_name)


@rule("mul-distribute", op("mul", op("add", X, Y), Z), "ac",
      [example(lambda b, x, y, z: b.op("mul", b.op("add", x, y), z), (2, 3), (2, 3), (3,))])
def mul_distribute(b, m):
    """(x + y) z = x z + y z"""
    _same_dtype(b, m["x"], m["y"], m["z"])
    return same(b, m.root, b.op("add", b.op("mul", m["x"], m["z"]), b.op("mul", m["y"], m["z"])))


@rule("mul-factor", op("add", op("mul", X, Z), op("mul", Y, Z)), "ac",
      [example(lambda b, x, y, z: b.op("add", b.op("mul", x, z), b.op("mul", y, z)),
               (2, 3), (2, 3), (3,))])
def mul_factor(b, m):
    """x z + y z = (x + y) z"""
    _same_dtype(b, m["x"], m["y"], m["z"])
    return same(b, m.root, b.op("mul", b.op("add", m["x"], m["y"]), m["z"]))


@rule("matmul-factor-left", op("add", op("matmul", X, Y), op("matmul", X, Z)), "algebra",
      [example(lambda b, x, y, z: b.op("add", b.op("matmul", x, y), b.op("matmul", x, z)),
               (3, 4), (4, 5), (4, 5))])
def matmul_factor_left(b, m):
    """x A + x B = x (A + B)"""
    require(b.type(m["y"]) == b.type(m["z"]), "different shapes")
    return same(b, m.root, b.op("matmul", m["x"], b.op("add", m["y"], m["z"])))


@rule("matmul-factor-right", op("add", op("matmul", X, Z), op("matmul", Y, Z)), "algebra",
      [example(lambda b, x, y, z: b.op("add", b.op("matmul", x, z), b.op("matmul", y, z)),
               (3, 4), (3, 4), (4, 5))])
def matmul_factor_right(b, m):
    """A x + B x = (A + B) x"""
    require(b.type(m["x"]) == b.type(m["y"]), "different shapes")
    return same(b, m.root, b.op("matmul", b.op("add", m["x"], m["y"]), m["z"]))


def _is_scalar(b, cid) -> bool:
    t = b.type(cid)
    return t.numel == 1 and t.rank == 0


@rule("scale-into-matmul-rhs", op("mul", op("matmul", X, Y), Const("c")), "algebra",
      [example(lambda b, x, y: b.op("mul", b.op("matmul", x, y), b.scalar(0.125, F32)),
               (2, 3, 4), (2, 4, 5))])
def scale_into_matmul_rhs(b, m):
    """(x y) s = x (y s) for a scalar s: the scale moves to the (smaller) operand."""
    require(_is_scalar(b, m["c"]), "not a scalar")
    return same(b, m.root, b.op("matmul", m["x"], b.op("mul", m["y"], m["c"])))


@rule("scale-into-matmul-lhs", op("mul", op("matmul", X, Y), Const("c")), "algebra",
      [example(lambda b, x, y: b.op("mul", b.op("matmul", x, y), b.scalar(0.125, F32)),
               (2, 3, 4), (2, 4, 5))])
def scale_into_matmul_lhs(b, m):
    """(x y) s = (x s) y for a scalar s."""
    require(_is_scalar(b, m["c"]), "not a scalar")
    return same(b, m.root, b.op("matmul", b.op("mul", m["x"], m["c"]), m["y"]))


@rule("matmul-associate", op("matmul", op("matmul", X, Y), Z), "algebra",
      [example(lambda b, x, y, z: b.op("matmul", b.op("matmul", x, y), z), (2, 3), (3, 4), (4, 5))])
def matmul_associate(b, m):
    """(A B) C = A (B C) for matrices; the cost model picks the cheaper order."""
    require(all(b.type(m[k]).rank == 2 for k in "xyz"), "batched")
    return b.op("matmul", m["x"], b.op("matmul", m["y"], m["z"]))


@rule("sub-to-add-neg", op("sub", X, Y), "ac",
      [example(lambda b, x, y: b.op("sub", x, y), (2, 3), (2, 3))])
def sub_to_add_neg(b, m):
    """x - y = x + (-y)"""
    _same_dtype(b, m["x"], m["y"])
    return same(b, m.root, b.op("add", m["x"], b.op("neg", m["y"])))


@rule("add-neg-to-sub", op("add", X, op("neg", Y)), "ac",
      [example(lambda b, x, y: b.op("add", x, b.op("neg", y)), (2, 3), (2, 3))])
def add_neg_to_sub(b, m):
    """x + (-y) = x - y"""
    _same_dtype(b, m["x"], m["y"])
    return same(b, m.root, b.op("sub", m["x"], m["y"]))


@rule("div-pow2-to-mul", op("div", X, Const("c"), rounding="none"), "algebra",
      [example(lambda b, x: b.op("div", x, b.scalar(8.0, F32)), (2, 3))])
def div_pow2_to_mul(b, m):
    """x / 2^k = x * 2^-k, exactly (strength reduction)"""
    value = scalar_of(b, m["c"])
    require(b.type(m["x"]).dtype.is_floating_point and value != 0, "not a float division")
    mantissa, _ = math.frexp(abs(value))
    require(mantissa == 0.5, "not a power of two")
    return same(b, m.root, b.op("mul", m["x"], b.scalar(1.0 / value, b.type(m["c"]).dtype)))


@rule("div-const-to-mul", op("div", X, Const("c"), rounding="none"), "algebra",
      [example(lambda b, x: b.op("div", x, b.const(rand(3).abs() + 1)), (2, 3))])
def div_const_to_mul(b, m):
    """x / c = x * (1/c) for a float constant c (within one rounding)"""
    require(b.type(m["x"]).dtype.is_floating_point and b.type(m["c"]).dtype.is_floating_point,
            "not a float division")
    return same(b, m.root, b.op("mul", m["x"], b.op("reciprocal", m["c"])))


@rule("pow2-to-mul", op("pow", X, Const("c")), "algebra",
      [example(lambda b, x: b.op("pow", x, b.scalar(2.0, F32)), (2, 3))])
def pow2_to_mul(b, m):
    """x ** 2 = x * x"""
    require(filled_with(b, m["c"], 2) and b.type(m["c"]).rank == 0, "not a square")
    return same(b, m.root, b.op("mul", m["x"], m["x"]))


@rule("pow-neg1-to-reciprocal", op("pow", X, Const("c")), "algebra",
      [example(lambda b, x: b.op("pow", x, b.scalar(-1.0, F32)), (2, 3))])
def pow_neg1(b, m):
    """x ** -1 = 1 / x"""
    require(filled_with(b, m["c"], -1) and b.type(m["c"]).rank == 0, "not -1")
    require(b.type(m["x"]).dtype.is_floating_point, "integer power")
    return same(b, m.root, b.op("reciprocal", m["x"]))


@rule("mul-two-to-add", op("mul", X, Const("c")), "algebra",
      [example(lambda b, x: b.op("mul", x, b.scalar(2.0, F32)), (2, 3))])
def mul_two_to_add(b, m):
    """x * 2 = x + x, exactly"""
    require(filled_with(b, m["c"], 2) and b.type(m["c"]).rank == 0, "not 2")
    return same(b, m.root, b.op("add", m["x"], m["x"]))


@rule("rsqrt", op("reciprocal", op("sqrt", X)), "algebra",
      [example(lambda b, x: b.op("reciprocal", b.op("sqrt", x)), (2, 3))])
def rsqrt(b, m):
    """1 / sqrt(x) = rsqrt(x)"""
    return b.op("rsqrt", m["x"])


@rule("div-by-sqrt", op("div", X, op("sqrt", Y), rounding="none"), "algebra",
      [example(lambda b, x, y: b.op("div", x, b.op("sqrt", y)), (2, 3), (2, 3))])
def div_by_sqrt(b, m):
    """x / sqrt(y) = x * rsqrt(y)"""
    return same(b, m.root, b.op("mul", m["x"], b.op("rsqrt", m["y"])))


@rule("mul-scalars", op("mul", op("mul", X, Const("c")), Const("d")), "algebra",
      [example(lambda b, x: b.op("mul", b.op("mul", x, b.scalar(3.0, F32)), b.scalar(0.5, F32)),
               (2, 3))])
def mul_scalars(b, m):
    """(x c) d = x (c d) for scalars c, d"""
    require(_is_scalar(b, m["c"]) and _is_scalar(b, m["d"]), "not scalars")
    _same_dtype(b, m["x"], m["c"], m["d"])
    return same(b, m.root, b.op("mul", m["x"], b.op("mul", m["c"], m["d"])))
