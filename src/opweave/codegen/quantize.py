"""Quantization arithmetic: scales and zero points, the C++ kernels that turn float32
activations into uint8 codes, and the max pooling of codes (codegen/int8.py says where
they are used).

Activations are asymmetric uint8: `activation_qparams` maps a range (widened to hold 0,
so zero is exact) onto [0, qmax]; weights symmetric int8 per output channel. The kernels
are built once per machine like the generated ones and called through `CppKernel`'s
recording protocol, so the native plan replays them: `Quantizer` at fixed scales (static
quantization), `DynamicQuantizer` at each call's own range (dynamic quantization).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from . import build
from .precision import cpu_flags


_EPS = float(torch.finfo(torch.float32).eps)  # the smallest scale (the kernels' 1.1920929e-07f)


def has_int8_units(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies u8 x s8 into 32 bits (VNNI or AMX) without saturating."""
    return bool(cpu_flags(cpuinfo) & {"avx512_vnni", "avx_vnni", "amx_int8"})


@lru_cache(maxsize=1)
def activation_qmax() -> int:
    """The largest uint8 code activations use here: 255, or 127 without int8 units."""
    return 255 if has_int8_units() else 127


def activation_qparams(low: float, high: float, qmax: int) -> tuple[float, int]:
    """(scale, zero point) mapping [low, high] (widened to hold 0, so zero is exact) onto
    the uint8 range [0, qmax]."""
    if not (_finite(low) and _finite(high)):
        raise ValueError(f"calibration saw a non-finite value (range {low}..{high})")
    low, high = min(low, 0.0), max(high, 0.0)
    if high == low:  # only zeros seen
        return 1.0, 0
    # at least float32's epsilon (torch.ao's floor): a denormal range's 1 / scale is infinite
    scale = max((high - low) / qmax, _EPS)
    zero_point = int(min(qmax, max(0, round(-low / scale))))
    return scale, zero_point


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def weight_qparams(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel: axis 0), symmetric."""
    w = weight.detach().float()
    amax = w.abs().reshape(w.shape[0], -1).amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.round(w / scale.reshape(shape)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


# -- the int8 group ------------------------------------------------------------------------


_QUANTIZE = r"""
// uint8 codes of `n` float32 values: rint(x * inv) + zero point, clamped to [0, qmax].
// The clamps are comparisons, not fmaxf/fminf: g++ calls those through libm for each
// value, and the loop stayed scalar (4.8 ns a value, 0.47 ms for BERT-base's [128, 768]
// on one Zen 4 core). A NaN fails the first comparison: code 0, never an undefined
// float-to-int conversion.
static void to_codes(uint8_t* out, const float* in, int64_t n, float inv, float zp,
                     float qmax) {
  #pragma omp parallel for num_threads(ow_team()) if (n > 32768) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float v = std::rint(in[i] * inv) + zp;
    v = v > 0.0f ? v : 0.0f;
    v = v < qmax ? v : qmax;
    out[i] = (uint8_t)(int32_t)v;
  }
}

// p: {1 / scale, zero point, element count, qmax} (doubles: one constant tensor).
extern "C" void ow_quantize_u8(void** argv) {
  const double* p = (const double*)argv[2];
  to_codes((uint8_t*)argv[0], (const float*)argv[1], (int64_t)p[2], (float)p[0],
           (float)p[1], (float)p[3]);
}

// The same at the scale and zero point of this call's own range (dynamic quantization):
// argv {codes, scale (float, 1), zero point (int64, 1), values, {element count, qmax}}.
extern "C" void ow_quantize_u8_dynamic(void** argv) {
  uint8_t* out = (uint8_t*)argv[0];
  float* scale_out = (float*)argv[1];
  int64_t* zp_out = (int64_t*)argv[2];
  const float* in = (const float*)argv[3];
  const double* p = (const double*)argv[4];
  const int64_t n = (int64_t)p[0];
  const float qmax = (float)p[1];
  float lo = 0.0f, hi = 0.0f;  // the range always holds 0, so zero is exact
  // (simd: without it g++ keeps the loop scalar; a NaN fails both comparisons, lane by
  // lane too, and is left out of the range)
  #pragma omp parallel for simd num_threads(ow_team()) if (n > 32768) reduction(min:lo) reduction(max:hi)
  for (int64_t i = 0; i < n; ++i) {
    lo = in[i] < lo ? in[i] : lo;
    hi = in[i] > hi ? in[i] : hi;
  }
  float scale = hi > lo ? (hi - lo) / qmax : 1.0f;
  // as activation_qparams: at least float32's epsilon (a denormal range would make 1 / scale
  // infinite), at most what keeps it finite
  scale = std::isfinite(scale) ? std::fmaxf(scale, 1.1920929e-07f) : 3.4028235e38f / qmax;
  float zp = std::rint(-lo / scale);
  zp = zp < 0.0f ? 0.0f : (zp > qmax ? qmax : zp);
  scale_out[0] = scale;
  zp_out[0] = (int64_t)zp;
  to_codes(out, in, n, 1.0f / scale, zp, qmax);
}

// Max pooling of channels-last uint8 codes [N, H, W, C] -> [N, OH, OW, C]: the codes of the
// pooled values, since quantizing is monotonic. Windows clipped to the image (padding is
// never a maximum), each holding at least one pixel, as torch requires; codes are >= 0.
// p: {N, H, W, C, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW}.
extern "C" void ow_max_pool_u8(void** argv) {
  uint8_t* out = (uint8_t*)argv[0];
  const uint8_t* in = (const uint8_t*)argv[1];
  const int64_t* p = (const int64_t*)argv[2];
  const int64_t n = p[0], h = p[1], w = p[2], c = p[3], oh = p[4], ow = p[5], kh = p[6],
                kw = p[7], sh = p[8], sw = p[9], ph = p[10], pw = p[11], dh = p[12], dw = p[13];
  #pragma omp parallel for num_threads(ow_team()) if (n * oh * ow * c > 32768) schedule(static)
  for (int64_t k = 0; k < n * oh * ow; ++k) {
    const int64_t b = k / (oh * ow), i = (k / ow) % oh, j = k % ow;
    uint8_t* o = out + k * c;
    for (int64_t ch = 0; ch < c; ++ch) o[ch] = 0;
    for (int64_t y = 0; y < kh; ++y) {
      const int64_t row = i * sh - ph + y * dh;
      if (row < 0 || row >= h) continue;
      for (int64_t x = 0; x < kw; ++x) {
        const int64_t col = j * sw - pw + x * dw;
        if (col < 0 || col >= w) continue;
        const uint8_t* pixel = in + ((b * h + row) * w + col) * c;
        #pragma omp simd
        for (int64_t ch = 0; ch < c; ++ch) o[ch] = pixel[ch] > o[ch] ? pixel[ch] : o[ch];
      }
    }
  }
}
"""


@lru_cache(maxsize=1)
def _quantizers():
    """The C++ quantizers {name: function} (built once per machine, cached like every
    kernel), or None where no compiler builds them (then torch ops quantize, about 5x
    slower)."""
    return build.helper_functions(
        _QUANTIZE, ("ow_quantize_u8", "ow_quantize_u8_dynamic", "ow_max_pool_u8"),
        "the int8 quantizer", "torch ops quantize activations instead (slower)")


def _call_kernel(fn, tensors: list[torch.Tensor]) -> None:
    """Call a quantizer on these tensors' data, telling the native plan's recorder (the
    protocol of generated kernels, `CppKernel`)."""
    from .lower import CppKernel

    if CppKernel.recording is not None:
        CppKernel.recording(ctypes.cast(fn, ctypes.c_void_p).value, tensors)
    fn((ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors]))


def _dense(x: torch.Tensor) -> bool:
    """Whether `x`'s elements fill its storage span exactly once, in any order of axes (a
    transposed [N, L, C] activation as [N, C, L] is): the quantizers then read it as flat
    memory, and `empty_like` gives the codes the same strides."""
    expected = 1
    for size, stride in sorted((d for d in zip(x.shape, x.stride()) if d[0] != 1),
                               key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


class Quantizer:
    """float32 -> uint8 codes at one scale and zero point. A call is one C++ kernel that
    the native plan records and replays like a generated one."""

    def __init__(self, scale: float, zero_point: int):
        self.scale, self.zero_point, self.qmax = scale, zero_point, activation_qmax()
        self._params: dict[int, torch.Tensor] = {}  # element count -> the kernel's constants

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:  # requantized by the group that made it
            return x
        kernels = _quantizers()
        if kernels is None or not _dense(x):
            return torch.clamp(torch.round(x * (1.0 / self.scale)) + self.zero_point,
                               0, self.qmax).to(torch.uint8)
        out = torch.empty_like(x, dtype=torch.uint8)
        params = self._params.get(x.numel())
        if params is None:
            params = torch.tensor([1.0 / self.scale, self.zero_point, x.numel(), self.qmax],
                                  dtype=torch.float64)
            self._params[x.numel()] = params
        _call_kernel(kernels["ow_quantize_u8"], [out, x, params])
        return out


class DynamicQuantizer:
    """float32 -> (uint8 codes, scale, zero point) at the range of each call's own values
    (dynamic quantization): one C++ kernel, scale and zero point as tensors."""

    def __init__(self):
        self.qmax = activation_qmax()
        self._params: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor):
        kernels = _quantizers()
        if kernels is None or not _dense(x):
            low, high = torch.aminmax(x)
            low, high = low.clamp(max=0.0), high.clamp(min=0.0)
            scale = torch.where(high > low, ((high - low) / self.qmax).clamp(min=_EPS),
                                torch.ones_like(high))
            zero_point = torch.round(-low / scale).clamp(0, self.qmax).to(torch.int64)
            codes = torch.clamp(torch.round(x / scale) + zero_point, 0, self.qmax)
            return codes.to(torch.uint8), scale, zero_point
        out = torch.empty_like(x, dtype=torch.uint8)
        scale = torch.empty((), dtype=torch.float32)
        zero_point = torch.empty((), dtype=torch.int64)
        params = self._params.get(x.numel())
        if params is None:
            params = torch.tensor([x.numel(), self.qmax], dtype=torch.float64)
            self._params[x.numel()] = params
        _call_kernel(kernels["ow_quantize_u8_dynamic"], [out, scale, zero_point, x, params])
        return out, scale, zero_point



class MaxPoolCodes:
    """`max_pool2d` (no ceil mode) of [N, C, H, W] uint8 codes, channels-last in and out:
    the codes of the pooled values (torch's own max pooling refuses uint8 images of this
    size). A call is one C++ kernel, recorded by the native plan."""

    def __init__(self, kernel, stride, padding, dilation):
        self.kernel, self.stride = list(kernel), list(stride or kernel)
        self.padding, self.dilation = list(padding), list(dilation)
        self._params: dict[tuple, tuple] = {}  # input shape -> (output shape, constants)

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        codes = codes.contiguous(memory_format=torch.channels_last)
        shape, params = self._geometry(tuple(codes.shape))
        out = torch.empty(shape, dtype=torch.uint8, memory_format=torch.channels_last)
        kernels = _quantizers()
        if kernels is None:  # no compiler: through float32, exactly
            return out.copy_(torch.nn.functional.max_pool2d(
                codes.float(), self.kernel, self.stride, self.padding, self.dilation))
        _call_kernel(kernels["ow_max_pool_u8"], [out, codes, params])
        return out

    def _geometry(self, size: tuple) -> tuple:
        found = self._params.get(size)
        if found is None:
            n, c, h, w = size
            (kh, kw), (sh, sw) = self.kernel, self.stride
            (ph, pw), (dh, dw) = self.padding, self.dilation
            oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
            ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
            params = torch.tensor([n, h, w, c, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw],
                                  dtype=torch.int64)
            found = self._params[size] = (n, c, oh, ow), params
        return found
