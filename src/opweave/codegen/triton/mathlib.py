"""Float math the generated Triton kernels call, written in `triton.language` alone.

libdevice's tanh and pow would be one call each on a GPU, but Triton's interpreter
(`TRITON_INTERPRET=1`, how every CI run checks these kernels on a CPU) cannot run
libdevice, and a formula that only ever ran on a GPU would be tested nowhere. These are
the C++ prelude's formulas (codegen/prelude.py), so both generators agree to a few ulps.
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
    """torch.pow for float32: exp2(b * log2|a|) with the sign of an odd integer power, NaN
    for a negative base and a fractional power, and the IEEE special cases of pow()."""
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    integral = tl.floor(b) == b
    odd = integral & (tl.floor(b * 0.5) * 2.0 != b)
    y = tl.where((a < 0.0) & odd, -mag, mag)
    y = tl.where((a < 0.0) & (~integral) & (tl.abs(b) != float("inf")), float("nan"), y)
    y = tl.where(b == 0.0, 1.0, y)    # pow(x, 0) is 1, NaN included
    y = tl.where(a == 1.0, 1.0, y)    # pow(1, y) is 1, NaN included
    return y
