"""Merging parallel matmuls and convolutions that read the same input (TASO's and IOS's
merges). These rules have two roots; both are replaced by slices of one bigger op."""
from __future__ import annotations

from ._helpers import Const, X, attrs_of, example, op, rand, require, rule
from .weights import _conv_example, _last_dim_vector


def _swapped(b, first: int, second: int, dim: int) -> bool:
    """Whether the second weight goes first. Weights are concatenated so that every part
    of one precedes every part of the other (by name): weights that share a part never
    merge (a merged matmul would merge again with its own pieces, without end), and each
    set of parts has one order, so every way of reaching it folds to the same constant."""
    a = b.store.parts(b.constant_name(first), dim)
    c = b.store.parts(b.constant_name(second), dim)
    require(max(a) < min(c) or max(c) < min(a), "weights overlap")
    return max(c) < min(a)


def _in_roots_order(outputs: list[int], swapped: bool) -> list[int]:
    return outputs[::-1] if swapped else outputs


def _split_last(b, merged: int, first: int, dim: int) -> list[int]:
    t = b.type(merged)
    return [b.op("slice", merged, dim=dim, start=0, end=first),
            b.op("slice", merged, dim=dim, start=first, end=t.shape[dim])]


@rule("merge-matmul", (op("matmul", X, Const("a")), op("matmul", X, Const("b"))), "merge",
      [example(lambda b, x: [b.op("matmul", x, b.const(rand(4, 5))),
                             b.op("matmul", x, b.const(rand(4, 6)))], (3, 4))])
def merge_matmul(b, m):
    """x A, x B = split(x [A B]): one GEMM reads x once (Q/K/V projections)"""
    ta, tb = b.type(m["a"]), b.type(m["b"])
    require(ta.rank == tb.rank == 2 and ta.shape[0] == tb.shape[0] and ta.dtype == tb.dtype,
            "weights do not stack")
    swap = _swapped(b, m["a"], m["b"], 1)
    first, second = (m["a"], ta.shape[1]), (m["b"], tb.shape[1])
    (a, width), (c, _) = (second, first) if swap else (first, second)
    merged = b.op("matmul", m["x"], b.op("cat", a, c, dim=1))
    return _in_roots_order(_split_last(b, merged, width, b.type(merged).rank - 1), swap)


@rule("merge-linear", (op("add", op("matmul", X, Const("a")), Const("p")),
                       op("add", op("matmul", X, Const("b")), Const("q"))), "merge",
      [example(lambda b, x: [b.op("add", b.op("matmul", x, b.const(rand(4, 5))), b.const(rand(5))),
                             b.op("add", b.op("matmul", x, b.const(rand(4, 6))), b.const(rand(6)))],
               (2, 3, 4))])
def merge_linear(b, m):
    """x A + p, x B + q = split(x [A B] + [p q]): the bias add is merged too"""
    ta, tb = b.type(m["a"]), b.type(m["b"])
    require(ta.rank == tb.rank == 2 and ta.shape[0] == tb.shape[0] and ta.dtype == tb.dtype,
            "weights do not stack")
    swap = _swapped(b, m["a"], m["b"], 1)
    first = (m["a"], _last_dim_vector(b, m["p"], ta.shape[1]), ta.shape[1])
    second = (m["b"], _last_dim_vector(b, m["q"], tb.shape[1]), tb.shape[1])
    (a, p, width), (c, q, _) = (second, first) if swap else (first, second)
    merged = b.op("add", b.op("matmul", m["x"], b.op("cat", a, c, dim=1)), b.op("cat", p, q, dim=0))
    return _in_roots_order(_split_last(b, merged, width, b.type(merged).rank - 1), swap)


def _merge_conv(name: str, has_bias: bool):
    def conv(w, cb, tag):
        return op("conv", X, Const(w), *([Const(cb)] if has_bias else []), bind=tag)

    def build(b, x):
        return [_conv_example(b, x, has_bias, 4), _conv_example(b, x, has_bias, 2)]

    @rule(name, (conv("w1", "b1", "c1"), conv("w2", "b2", "c2")), "merge-conv",
          [example(build, (1, 3, 6, 6))],
          "conv(x, W1), conv(x, W2) = split(conv(x, [W1; W2])) along channels (IOS's merge)")
    def rhs(b, m):
        attrs = attrs_of(m.node("c1"))
        require(attrs == attrs_of(m.node("c2")) and attrs["groups"] == 1, "different convs")
        t1, t2 = b.type(m["w1"]), b.type(m["w2"])
        require(t1.shape[1:] == t2.shape[1:] and t1.dtype == t2.dtype, "kernels differ")
        swap = _swapped(b, m["w1"], m["w2"], 0)
        first, second = ("w1", "b1", t1), ("w2", "b2", t2)
        (w, cb, t), (w_, cb_, _) = (second, first) if swap else (first, second)
        bias = [b.op("cat", m[cb], m[cb_], dim=0)] if has_bias else []
        merged = b.op("conv", m["x"], b.op("cat", m[w], m[w_], dim=0), *bias, **attrs)
        return _in_roots_order(_split_last(b, merged, t.shape[0], 1), swap)
    return rhs


_merge_conv("merge-conv", has_bias=False)
_merge_conv("merge-conv-bias", has_bias=True)
