"""Float math the generated Triton kernels call, written in `triton.language` alone.

libdevice's tanh and pow would be one call each on a GPU, but Triton's interpreter
(`TRITON_INTERPRET=1`, how every CI run checks these kernels on a CPU) cannot run
libdevice, and a formula that only ever ran on a GPU would be tested nowhere. tanh is
the C++ prelude's formula (codegen/prelude.py); pow is below.
"""
import triton
import triton.language as tl


@triton.jit
def ow_tanh(x):
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = a * (1.0 + x2 * (-0.333333333 + x2 * (0.133333333 - x2 * 0.0539682540)))
    y = tl.where(a < 0.0625, small, big)
    y = tl.where(x < 0.0, -y, y)
    return tl.where(x != x, x, y)


@triton.jit
def ow_sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def ow_pow(a, b):
    """torch.pow for float32 with a general exponent (the renderer spells 2, 3, -1, -2,
    0.5 and -0.5 as torch does: products, division, square roots). The magnitude is
    exp2(b * log2|a|) in float64, so a large result keeps float32's precision; the sign
    is a's for an odd integer power (-0.0 included); a negative base with a fractional
    power is NaN; and IEEE pow's special cases: pow(x, 0) = pow(1, y) = pow(-1, +-inf)
    = 1."""
    a64 = a.to(tl.float64)
    b64 = b.to(tl.float64)
    mag = tl.exp2(b64 * tl.log2(tl.abs(a64))).to(tl.float32)
    integral = tl.floor(b) == b
    odd = integral & (tl.floor(b * 0.5) * 2.0 != b)
    negative = (a < 0.0) | ((a == 0.0) & (1.0 / a < 0.0))  # -0.0 too
    y = tl.where(negative & odd, -mag, mag)
    y = tl.where((a < 0.0) & (a != -float("inf")) & (~integral), float("nan"), y)
    y = tl.where((a == -1.0) & (tl.abs(b) == float("inf")), 1.0, y)
    y = tl.where(b == 0.0, 1.0, y)    # pow(x, 0) is 1, NaN included
    y = tl.where(a == 1.0, 1.0, y)    # pow(1, y) is 1, NaN included
    return y
