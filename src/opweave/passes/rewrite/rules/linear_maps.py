"""Convolutions as linear maps: one over a concatenation of channels is the sum of
convolutions over the parts, and a 1x1 convolution (a map across channels at each pixel)
commutes with upsampling (a map across pixels of each channel, with weights summing to
one). Together they move a decoder's fusing convolution (SegFormer's head: four feature
maps upsampled to a quarter of the image, concatenated, one 1x1 conv) to each map's own
resolution. Both hold within float rounding; the extraction keeps whichever costs less."""
from __future__ import annotations

from ._helpers import X, attrs_of, example, op, op_any_arity, rand, require, rule, same

UPSAMPLING = ("upsample_nearest2d", "upsample_bilinear2d")


def _cat_conv_example(b, x, y):
    w, bias = b.const(rand(4, 5, 3, 3)), b.const(rand(4))
    return b.op("conv", b.op("cat", x, y, dim=1), w, bias, stride=[2, 1], padding=[1, 1],
                dilation=[1, 1], groups=1)


@rule("conv-over-cat", op_any_arity("conv", "conv"), "algebra",
      [example(_cat_conv_example, (1, 2, 6, 6), (1, 3, 6, 6))])
def conv_over_cat(b, m):
    """conv(cat(x1, .., xk over channels), W, c) = conv(x1, W1, c) + .. + conv(xk, Wk),
    Wi the columns of W reading xi's channels"""
    conv = m.node("conv")
    x, w, *bias = conv.children
    rank = b.type(x).rank
    require(conv.attr("groups") == 1, "grouped")
    require(b.constant_name(w) is not None, "the weight is computed")
    cats = [e for e in b.view.enodes(x) if e.op == "cat" and e.attr("dim") % rank == 1]
    require(bool(cats), "not over a concatenation of channels")
    attrs, total, start = attrs_of(conv), None, 0
    for part in cats[0].children:
        channels = b.type(part).shape[1]
        weight = b.op("slice", w, dim=1, start=start, end=start + channels)
        term = b.op("conv", part, weight, *(bias if total is None else []), **attrs)
        total = term if total is None else b.op("add", total, term)
        start += channels
    return same(b, m.root, total)


def _upsampled_conv_example(b, x):
    up = b.op("upsample_bilinear2d", x, size=[7, 10], align_corners=False)
    return b.op("conv", up, b.const(rand(5, 3, 1, 1)), b.const(rand(5)), stride=[1, 1],
                padding=[0, 0], dilation=[1, 1], groups=1)


@rule("pointwise-conv-before-upsampling", op_any_arity("conv", "conv"), "algebra",
      [example(_upsampled_conv_example, (1, 3, 4, 5))])
def pointwise_conv_before_upsampling(b, m):
    """conv1x1(upsample(x), W, c) = upsample(conv1x1(x, W, c)): upsampling mixes pixels with
    weights summing to one, the 1x1 convolution mixes channels, pixel by pixel"""
    conv = m.node("conv")
    x, *rest = conv.children
    attrs = attrs_of(conv)
    require(b.type(rest[0]).shape[2:] == (1, 1) and attrs["stride"] == [1, 1] and
            attrs["padding"] == [0, 0], "not a pointwise convolution")
    ups = [e for e in b.view.enodes(x) if e.op in UPSAMPLING]
    require(bool(ups), "not of an upsampled input")
    (inner,) = ups[0].children
    mixed = b.op("conv", inner, *rest, **attrs)
    return same(b, m.root, b.op(ups[0].op, mixed, **attrs_of(ups[0])))


@rule("upsampling-noop", op(UPSAMPLING, X, bind="up"), "simplify",
      [example(lambda b, x: b.op("upsample_bilinear2d", x, size=[3, 4]), (1, 2, 3, 4))])
def upsampling_noop(b, m):
    """upsampling to the input's own size (by no factor, or a factor of one) copies it"""
    a = attrs_of(m.node("up"))
    require(tuple(a["size"]) == b.type(m["x"]).shape[2:] and
            a["scales_h"] in (None, 1.0) and a["scales_w"] in (None, 1.0), "resizes")
    return same(b, m.root, m["x"])
