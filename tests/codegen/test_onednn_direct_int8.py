"""Precision "int8" on oneDNN's own library: the form "onednn-int8-direct", uint8 source
codes, int8 weights with a scale per output channel, a float32 bias, the epilogue in
float32, and a float32 result or uint8 codes (codegen/onednn_direct.py). Each result is
checked against float64 arithmetic on the dequantized operands: float32 results to
float32's rounding, codes to within one code (a value on a rounding tie)."""
from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from opweave.codegen import onednn_direct, quantize

from .test_onednn_direct import CONV_GEOMETRIES
from .test_onednn_direct_bf16 import _epilogue

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="oneDNN's pip package is for x86-64 Linux")
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _needs_int8_primitives():
    problem = onednn_direct.int8_problem()
    if problem is not None:
        pytest.skip(f"oneDNN's library has no int8 primitives on this CPU: {problem}")


def _codes(t: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """`t` as uint8 codes at the scale and zero point of its own range, and those."""
    scale, zero_point = quantize.activation_qparams(float(t.min()), float(t.max()),
                                                    quantize.activation_qmax())
    return quantize.Quantizer(scale, zero_point)(t), scale, zero_point


def _values(codes: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    return (codes.double() - zero_point) * scale


def _assert_result(got: torch.Tensor, want: torch.Tensor, out) -> None:
    """A float32 result within float32's rounding of `want`; codes equal to `want`
    quantized at `out`, but for values within float32's rounding of a tie between two
    codes (tanh's saturated 1.0 at a scale of 2/255 is one), which may take either."""
    if out is None:
        assert got.dtype == torch.float32
        error = float((got.double() - want).abs().max())
        assert error <= 1e-5 * max(1.0, float(want.abs().max())), error
        return
    assert got.dtype == torch.uint8
    scale, zero_point = out
    exact = want / scale + zero_point
    codes = torch.clamp(torch.round(exact), 0, quantize.activation_qmax())
    off = (got.double() - codes).abs()
    tie = ((exact - exact.floor()) - 0.5).abs() < 1e-4
    assert float(off.max()) <= 1 and not bool((off > 0)[~tie].any())


# (residual, whether the result is codes): no residual; one summed in place (float32, or
# codes where the result is codes); one added into a new result (float32 only: a
# convolution writing codes sums into its residual)
CONV_OUTPUTS = [("none", False), ("none", True), ("sum", False), ("sum", True), ("add", False)]


# the float32 tests' geometries and a depthwise one
# (N, C, H, W, O, K, stride, padding, dilation, groups)
INT8_GEOMETRIES = CONV_GEOMETRIES + [(1, 16, 9, 9, 16, 3, 1, 1, 1, 16)]


@pytest.mark.parametrize("geometry", INT8_GEOMETRIES)
@pytest.mark.parametrize("unary", [None, "relu"])
@pytest.mark.parametrize(("residual", "writes_codes"), CONV_OUTPUTS)
def test_conv_matches_its_float64_simulation(geometry, unary, residual, writes_codes):
    n, c, h, w, o, k, s, p, d, g = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, c, h, w), torch.randn(o, c // g, k, k), torch.randn(o)
    xq, scale, zero_point = _codes(x.contiguous(memory_format=CL))
    wq, w_scales = quantize.weight_qparams(weight)
    want = F.conv2d(_values(xq, scale, zero_point), wq.double() * w_scales.double().reshape(-1, 1, 1, 1),
                    bias.double(), s, p, d, g)
    residual_value = acc = accum = None
    if residual != "none":
        r = torch.randn(want.shape).contiguous(memory_format=CL)
        if writes_codes:
            r, *accum = _codes(r)
            accum = tuple(accum)
            residual_value = _values(r, *accum)
        else:
            residual_value = r.double()
        acc = r.clone(memory_format=CL)
        want = want + residual_value
    want = _epilogue(want, unary, None)
    out = None
    if writes_codes:
        low, high = float(want.min()), float(want.max())
        out = quantize.activation_qparams(low, high, quantize.activation_qmax())
    binary = {"none": onednn_direct.NO_BINARY, "sum": onednn_direct.SUM_IN_PLACE,
              "add": onednn_direct.ADD}[residual]
    conv = onednn_direct.DirectConv(
        (n, c, h, w, o, k, k, g, s, s, p, p, d, d), wq, bias, unary, binary,
        quant=onednn_direct.Int8Quantization(scale, zero_point, w_scales, out, accum))
    try:
        got = conv(xq, acc)
    except onednn_direct.ReferenceOnly as err:
        if quantize.has_int8_units():  # with VNNI or AMX every geometry has its kernel
            raise
        pytest.skip(str(err))
    _assert_result(got, want, out)
    if residual == "sum":
        assert got.data_ptr() == acc.data_ptr()  # summed in place


@pytest.mark.parametrize("unary", [None, "relu", "tanh", ("gelu", "none"), ("gelu", "tanh")])
# a product adding a residual writes float32
@pytest.mark.parametrize(("residual", "writes_codes"), [(False, False), (False, True), (True, False)])
def test_linear_matches_its_float64_simulation(unary, residual, writes_codes):
    m, k, n = 24, 72, 40
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    xq, scale, zero_point = _codes(x)
    wq, w_scales = quantize.weight_qparams(weight.t())  # per output column
    want = _values(xq, scale, zero_point) @ (wq.double() * w_scales.double()[:, None]).t() \
        + bias.double()
    other = torch.randn(m, n) if residual else None
    if residual:
        want = want + other.double()
    want = _epilogue(want, unary, None)
    out = quantize.activation_qparams(float(want.min()), float(want.max()),
                                      quantize.activation_qmax()) if writes_codes else None
    product = onednn_direct.DirectLinear(
        (m, k, n), wq.t(), bias, unary,
        onednn_direct.ADD if residual else onednn_direct.NO_BINARY,
        quant=onednn_direct.Int8Quantization(scale, zero_point, w_scales, out))
    _assert_result(product(xq, other), want, out)


def test_a_primitive_for_another_thread_count_computes_the_same():
    """Its int8 weights are packed again from the plain ones (their compensation terms are
    not reordered between layouts)."""
    torch.manual_seed(0)
    xq, scale, zero_point = _codes(torch.randn(1, 32, 8, 8).contiguous(memory_format=CL))
    wq, w_scales = quantize.weight_qparams(torch.randn(48, 32, 3, 3))
    conv = onednn_direct.DirectConv((1, 32, 8, 8, 48, 3, 3, 1, 1, 1, 1, 1, 1, 1), wq, None,
                                    quant=onednn_direct.Int8Quantization(scale, zero_point,
                                                                          w_scales))
    threads = torch.get_num_threads()
    first = conv(xq)
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = conv(xq)
    finally:
        torch.set_num_threads(threads)
    assert conv.variants() == 1
    assert torch.equal(first, other)


def test_operands_of_another_type_are_refused_by_name():
    wq, w_scales = quantize.weight_qparams(torch.randn(8, 16))
    quant = onednn_direct.Int8Quantization(0.1, 3, w_scales)
    product = onednn_direct.DirectLinear((4, 16, 8), wq.t(), None, quant=quant)
    with pytest.raises(ValueError, match=r"\(4, 16\) uint8 on the CPU got \(4, 16\) torch.float32"):
        product(torch.randn(4, 16))
    wide = onednn_direct.DirectLinear((4, 16, 8), torch.randn(16, 8), None, quant=quant)
    with pytest.raises(ValueError, match="takes an int8 weight, not torch.float32"):
        wide(torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="an int8 sum into codes writes codes"):
        onednn_direct.Int8Quantization(0.1, 3, w_scales, None, (0.1, 3)).packed()
    with pytest.raises(ValueError, match="in bf16 or int8 from 1"):
        onednn_direct.DirectLinear((4, 16, 8), wq.t(), None, parts=3, quant=quant)


def test_a_nonpositive_scale_is_refused_when_the_primitive_is_made():
    wq, w_scales = quantize.weight_qparams(torch.randn(8, 16))
    product = onednn_direct.DirectLinear((4, 16, 8), wq.t(), None,
                                         quant=onednn_direct.Int8Quantization(0.0, 3, w_scales))
    with pytest.raises(RuntimeError, match="int8 scales must be positive"):
        product(torch.zeros(4, 16, dtype=torch.uint8))


def test_quantization_the_primitive_would_misread_is_refused():
    wq, w_scales = quantize.weight_qparams(torch.randn(8, 16))
    with pytest.raises(ValueError, match="with 8 outputs got 2 weight scales"):
        onednn_direct.DirectLinear((4, 16, 8), wq.t(), None,
                                   quant=onednn_direct.Int8Quantization(0.1, 3, w_scales[:2]))
    wq, w_scales = quantize.weight_qparams(torch.randn(8, 4, 3, 3))
    geometry = (1, 4, 6, 6, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="summing in place writes its residual's type"):
        onednn_direct.DirectConv(geometry, wq, None, None, onednn_direct.SUM_IN_PLACE,
                                 quant=onednn_direct.Int8Quantization(0.1, 3, w_scales,
                                                                      out=(0.1, 0)))


@pytest.mark.parametrize("residual", [False, True])
def test_a_dynamically_quantized_source_takes_each_calls_scale(residual):
    """Dynamic quantization: the source's scale and zero point come with each call (as
    `DynamicQuantizer` makes them), so one primitive serves sources of any range."""
    m, k, n = 24, 72, 40
    torch.manual_seed(0)
    weight, bias = torch.randn(k, n), torch.randn(n)
    wq, w_scales = quantize.weight_qparams(weight.t())
    product = onednn_direct.DirectLinear(
        (m, k, n), wq.t(), bias, "relu" if not residual else None,
        onednn_direct.ADD if residual else onednn_direct.NO_BINARY,
        quant=onednn_direct.Int8Quantization(1.0, 0, w_scales, dynamic=True))
    scales = set()
    for spread in (1.0, 10.0):
        x, other = torch.randn(m, k) * spread, torch.randn(m, n)
        codes, scale, zero_point = quantize.DynamicQuantizer()(x)
        scales.add(float(scale))
        want = _values(codes, float(scale), int(zero_point)) \
            @ (wq.double() * w_scales.double()[:, None]).t() + bias.double()
        want = want + other.double() if residual else want.relu()
        got = product(codes, other if residual else None, (scale, zero_point))
        _assert_result(got, want, None)
    assert len(scales) == 2


def test_dynamic_quantization_is_refused_where_it_cannot_apply():
    wq, w_scales = quantize.weight_qparams(torch.randn(8, 16))
    dynamic = onednn_direct.Int8Quantization(1.0, 0, w_scales, dynamic=True)
    product = onednn_direct.DirectLinear((4, 16, 8), wq.t(), None, quant=dynamic)
    codes = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="takes the source's scale and zero point with each call"):
        product(codes)
    with pytest.raises(ValueError, match="one float32 and one int64"):
        product(codes, None, (torch.tensor(0.1, dtype=torch.float64), torch.tensor(3)))
    static = onednn_direct.DirectLinear(
        (4, 16, 8), wq.t(), None, quant=onednn_direct.Int8Quantization(0.1, 3, w_scales))
    with pytest.raises(ValueError, match="only where quantized dynamically"):
        static(codes, None, (torch.tensor(0.1), torch.tensor(3)))
    wq4, w4_scales = quantize.weight_qparams(torch.randn(8, 4, 3, 3))
    with pytest.raises(ValueError, match="dynamic int8 quantization is for linear layers"):
        onednn_direct.DirectConv((1, 4, 6, 6, 8, 3, 3, 1, 1, 1, 1, 1, 1, 1), wq4, None,
                                 quant=onednn_direct.Int8Quantization(1.0, 0, w4_scales,
                                                                      dynamic=True))
