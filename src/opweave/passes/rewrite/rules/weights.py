"""Folding into weights: batch norm, scales and biases into conv and matmul weights."""
from __future__ import annotations

from ._helpers import Const, X, attrs_of, example, op, rand, require, rule, same

_CONV = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1])


def _conv_example(b, x, bias=False, out=4):
    args = [x, b.const(rand(out, 3, 3, 3))] + ([b.const(rand(out))] if bias else [])
    return b.op("conv", *args, **_CONV)


def _per_channel(b, c, channels: int, out_rank: int) -> int:
    """A constant broadcast over the channel dim of a conv output, as a [C] vector."""
    t = b.type(c)
    require(t.rank <= out_rank, "broadcasts up")
    full = (1,) * (out_rank - t.rank) + t.shape
    require(all(d == 1 for i, d in enumerate(full) if i != 1) and full[1] in (1, channels),
            "not per channel")
    flat = b.op("reshape", c, shape=[full[1]])
    return flat if full[1] == channels else b.op("expand", flat, shape=[channels])


def _bn_into_conv(name: str, has_bias: bool):
    conv = op("conv", X, Const("w"), *([Const("cb")] if has_bias else []), bind="conv")
    pattern = op("batch_norm", conv, Const("g"), Const("beta"), Const("mean"), Const("var"),
                 bind="bn")

    def build(b, x):
        y = _conv_example(b, x, has_bias)
        stats = [b.const(rand(4)), b.const(rand(4)), b.const(rand(4)), b.const(rand(4).abs() + 0.5)]
        return b.op("batch_norm", y, *stats, eps=1e-5)

    @rule(name, pattern, "weights", [example(build, (1, 3, 6, 6))],
          "batch_norm(conv(x, W, b)) = conv(x, W s, (b - mean) s + beta), s = g / sqrt(var + eps)")
    def rhs(b, m):
        w_t = b.type(m["w"])
        eps = b.scalar(float(m.node("bn").attr("eps")), w_t.dtype)
        scale = b.op("div", m["g"], b.op("sqrt", b.op("add", m["var"], eps)))
        weight = b.op("mul", m["w"], b.op("reshape", scale, shape=[w_t.shape[0]] + [1] * (w_t.rank - 1)))
        shift = b.op("neg", m["mean"]) if not has_bias else b.op("sub", m["cb"], m["mean"])
        bias = b.op("add", b.op("mul", shift, scale), m["beta"])
        return same(b, m.root, b.op("conv", m["x"], weight, bias, **attrs_of(m.node("conv"))))
    return rhs


_bn_into_conv("batchnorm-into-conv", has_bias=False)
_bn_into_conv("batchnorm-into-conv-bias", has_bias=True)


def _scale_into_conv(name: str, has_bias: bool):
    conv = op("conv", X, Const("w"), *([Const("cb")] if has_bias else []), bind="conv")

    def build(b, x):
        return b.op("mul", _conv_example(b, x, has_bias), b.const(rand(4, 1, 1)))

    @rule(name, op("mul", conv, Const("s")), "weights", [example(build, (1, 3, 6, 6))],
          "conv(x, W, b) * s = conv(x, W s, b s) for a per-channel s")
    def rhs(b, m):
        w_t = b.type(m["w"])
        s = _per_channel(b, m["s"], w_t.shape[0], w_t.rank)
        weight = b.op("mul", m["w"], b.op("reshape", s, shape=[w_t.shape[0]] + [1] * (w_t.rank - 1)))
        bias = [b.op("mul", m["cb"], s)] if has_bias else []
        return same(b, m.root, b.op("conv", m["x"], weight, *bias, **attrs_of(m.node("conv"))))
    return rhs


_scale_into_conv("scale-into-conv", has_bias=False)
_scale_into_conv("scale-into-conv-bias", has_bias=True)


def _bias_into_conv(name: str, has_bias: bool):
    conv = op("conv", X, Const("w"), *([Const("cb")] if has_bias else []), bind="conv")

    def build(b, x):
        return b.op("add", _conv_example(b, x, has_bias), b.const(rand(1, 4, 1, 1)))

    @rule(name, op("add", conv, Const("c")), "weights", [example(build, (1, 3, 6, 6))],
          "conv(x, W, b) + c = conv(x, W, b + c) for a per-channel c")
    def rhs(b, m):
        w_t = b.type(m["w"])
        c = _per_channel(b, m["c"], w_t.shape[0], w_t.rank)
        bias = b.op("add", m["cb"], c) if has_bias else c
        return same(b, m.root, b.op("conv", m["x"], m["w"], bias, **attrs_of(m.node("conv"))))
    return rhs


_bias_into_conv("bias-into-conv", has_bias=False)
_bias_into_conv("bias-into-conv-bias", has_bias=True)


def _last_dim_vector(b, c, n: int) -> int:
    """A constant broadcast along the last dim of an [.., n] result, as an [n] vector."""
    t = b.type(c)
    require(all(d == 1 for d in t.shape[:-1]) and t.rank >= 1 and t.shape[-1] in (1, n)
            or t.rank == 0, "not along the last dim")
    flat = b.op("reshape", c, shape=[t.numel])
    return flat if t.numel == n else b.op("expand", flat, shape=[n])


@rule("scale-into-linear-weight", op("mul", op("matmul", X, Const("w")), Const("s")), "weights",
      [example(lambda b, x: b.op("mul", b.op("matmul", x, b.const(rand(4, 5))), b.const(rand(5))),
               (3, 4))])
def scale_into_linear_weight(b, m):
    """(x W) s = x (W s) for s along the output features"""
    w_t = b.type(m["w"])
    require(w_t.rank == 2, "batched weight")
    s = _last_dim_vector(b, m["s"], w_t.shape[1])
    return same(b, m.root, b.op("matmul", m["x"], b.op("mul", m["w"], s)))


@rule("scale-into-linear", op("mul", op("add", op("matmul", X, Const("w")), Const("bias")), Const("s")),
      "weights",
      [example(lambda b, x: b.op("mul", b.op("add", b.op("matmul", x, b.const(rand(4, 5))),
                                             b.const(rand(5))), b.scalar(0.125, rand(1).dtype)),
               (3, 4))])
def scale_into_linear(b, m):
    """(x W + c) s = x (W s) + c s for s along the output features"""
    w_t = b.type(m["w"])
    require(w_t.rank == 2, "batched weight")
    s = _last_dim_vector(b, m["s"], w_t.shape[1])
    inner = b.op("matmul", m["x"], b.op("mul", m["w"], s))
    return same(b, m.root, b.op("add", inner, b.op("mul", m["bias"], s)))
