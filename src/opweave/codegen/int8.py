"""Static int8 quantization of library groups (`precision="int8"`; docs/precision.md).

The policy. Linear layers and convolutions with constant weights (the library groups)
compute in int8 through oneDNN's `qlinear_pointwise` / `qconv2d_pointwise`:
- weights: symmetric int8, one scale per output channel (max |w| / 127);
- activations: asymmetric uint8 over one scale and zero point per tensor, from the
  minimum and maximum each group's input reached in calibration (post-training static
  quantization). On a CPU without VNNI or AMX int8 units the activations use 7 bits (0 to
  127): oneDNN's AVX2 path adds pairs of u8 x s8 products in 16 bits, which saturates at
  8-bit activations (the range fbgemm also reduces there);
- the product accumulates in int32; dequantization, bias, the activation (ReLU, GELU,
  tanh where oneDNN fuses it) and a residual add are fused into the same primitive, which
  writes float32. Where every reader of a group's result is itself an int8 group reading
  it as its activation, the primitive requantizes into those readers' uint8 scale instead
  (fused requantization), and the readers quantize nothing.
Everything else (norms, softmax, attention, pointwise kernels, products of two run-time
operands) stays float32, and graph inputs and outputs are float32.

Calibration. A group chosen int8 computes its float32 form while it calibrates, keeping
its input's range; `finish` then fixes the scales and switches it to int8. The pipeline
attaches a `Calibration` to each executor with such groups. Calls made inside
`calibrating()` calibrate (what `opweave.compile(..., calibration=[...])` does with the
batches given, or with the example inputs), and a graph called before any calibration
(a plan built for new sizes, a torch.compile graph) calibrates on its first call.
The measured choice between the int8 and the float32 form is made at compile time with
provisional scales (the time does not depend on them), as every library choice is.
"""
from __future__ import annotations

import ctypes
import threading
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Callable

import torch

from . import build
from .precision import _cpuinfo

QUANTIZED_OPS = frozenset({"matmul", "conv"})
# the ops each int8 precision quantizes: "int8-dynamic" only linear layers (as torch's
# dynamic quantization), their activations' ranges measured on every call
_OPS_OF = {"int8": QUANTIZED_OPS, "int8-dynamic": frozenset({"matmul"})}
# unary epilogues oneDNN fuses into an int8 product, per anchor op
FUSED_UNARY = {"matmul": frozenset({"relu", "gelu", "tanh"}), "conv": frozenset({"relu"})}
_PROVISIONAL = (8.0 / 255, 128)  # scale and zero point while measuring, before calibration


def applies(precision: str, op: str) -> bool:
    """Whether a library group anchored on `op` may compute in int8 under `precision`."""
    return op in quantized_ops(precision)


def quantized_ops(precision: str) -> frozenset[str]:
    return _OPS_OF.get(precision, frozenset())


def has_int8_units(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies u8 x s8 into 32 bits (VNNI or AMX) without saturating."""
    flags = _flags(_cpuinfo() if cpuinfo is None else cpuinfo)
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


@lru_cache(maxsize=1)
def activation_qmax() -> int:
    """The largest uint8 code activations use here: 255, or 127 without int8 units."""
    return 255 if has_int8_units() else 127


def units(cpuinfo: str | None = None) -> str:
    """The CPU's int8 units, as `explain` and the bench report them."""
    flags = _flags(_cpuinfo() if cpuinfo is None else cpuinfo)
    if "amx_int8" in flags:
        return "AMX int8 tiles"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "VNNI int8 dot products (no AMX)"
    return "no int8 dot-product units: 7-bit activations, slower than VNNI"


def _flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[-1].split())
    return set()


def activation_qparams(low: float, high: float, qmax: int) -> tuple[float, int]:
    """(scale, zero point) mapping [low, high] (widened to hold 0, so zero is exact) onto
    the uint8 range [0, qmax]."""
    if not (_finite(low) and _finite(high)):
        raise ValueError(f"calibration saw a non-finite value (range {low}..{high})")
    low, high = min(low, 0.0), max(high, 0.0)
    if high == low:  # only zeros seen
        return 1.0, 0
    scale = (high - low) / qmax
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


# -- quantizing activations ----------------------------------------------------------------

_QUANTIZE = r"""
// uint8 codes of float32 values: rint(x / scale) + zero point, clamped to [0, qmax].
// p: {1 / scale, zero point, element count, qmax} (doubles: one constant tensor).
extern "C" void ow_quantize_u8(void** argv) {
  uint8_t* out = (uint8_t*)argv[0];
  const float* in = (const float*)argv[1];
  const double* p = (const double*)argv[2];
  const float inv = (float)p[0], zp = (float)p[1], qmax = (float)p[3];
  const int64_t n = (int64_t)p[2];
  #pragma omp parallel for num_threads(ow_team()) if (n > 32768) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float v = std::rint(in[i] * inv) + zp;
    v = v < 0.0f ? 0.0f : (v > qmax ? qmax : v);
    out[i] = (uint8_t)(int32_t)v;
  }
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
  #pragma omp parallel for num_threads(ow_team()) if (n > 32768) reduction(min:lo) reduction(max:hi)
  for (int64_t i = 0; i < n; ++i) {
    lo = in[i] < lo ? in[i] : lo;
    hi = in[i] > hi ? in[i] : hi;
  }
  float scale = hi > lo ? (hi - lo) / qmax : 1.0f;
  float zp = std::rint(-lo / scale);
  zp = zp < 0.0f ? 0.0f : (zp > qmax ? qmax : zp);
  scale_out[0] = scale;
  zp_out[0] = (int64_t)zp;
  const float inv = 1.0f / scale;
  #pragma omp parallel for num_threads(ow_team()) if (n > 32768) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float v = std::rint(in[i] * inv) + zp;
    v = v < 0.0f ? 0.0f : (v > qmax ? qmax : v);
    out[i] = (uint8_t)(int32_t)v;
  }
}
"""


@lru_cache(maxsize=1)
def _quantizers():
    """The C++ quantizers {name: function} (built once per machine, cached like every
    kernel), or None where no compiler builds them (then torch ops quantize, about 5x
    slower)."""
    try:
        lib = build.load(_QUANTIZE)
    except build.BuildError as err:
        warnings.warn(f"opweave: the int8 quantizer could not be built ({err}); torch ops "
                      "quantize activations instead (slower)", RuntimeWarning, stacklevel=2)
        return None
    lib.ow_set_threads(torch.get_num_threads())
    found = {}
    for name in ("ow_quantize_u8", "ow_quantize_u8_dynamic"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        fn.restype = None
        found[name] = fn
    return found


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
            scale = torch.where(high > low, (high - low) / self.qmax, torch.ones_like(high))
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


# -- the int8 group ------------------------------------------------------------------------

class Range:
    """The minimum and maximum a tensor reached over calibration calls."""

    def __init__(self):
        self.low = self.high = None

    def observe(self, x: torch.Tensor) -> None:
        low, high = torch.aminmax(x.detach())
        low, high = float(low), float(high)
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def qparams(self) -> tuple[float, int]:
        if self.low is None:
            raise RuntimeError("an int8 group was never reached in calibration")
        return activation_qparams(self.low, self.high, activation_qmax())


class Int8Group:
    """A library group computed in int8. `build(scale, zero_point, out, accum)` returns its
    int8 function for an input quantized at (scale, zero point), writing float32, or uint8
    codes at `out` = (scale, zero point) when given; a convolution with a residual add
    (`sums`) reads its residual as uint8 codes at `accum` when given, and then writes
    uint8 (oneDNN's sum post-op keeps the accumulator's type). `fp32` is its float32 form,
    run while it calibrates. States: "measuring" (provisional scales, for timing),
    "calibrating" (float32, keeping the ranges of its input and residual), "ready" (int8)."""

    def __init__(self, build: Callable, fp32: Callable, requantizes: bool, sums: bool = False):
        self.build, self.fp32 = build, fp32
        self.requantizes = requantizes  # whether `build` may write uint8
        self.sums = sums                # a convolution summing into its residual
        self.state = "measuring"
        self.input_range, self.accum_range = Range(), Range()
        self.qparams: tuple[float, int] | None = None        # its input's
        self.accum_qparams: tuple[float, int] | None = None  # its residual's (`sums`)
        self.requantize: tuple[float, int] | None = None     # its readers' input qparams
        self.accum_in_uint8 = False
        # set by `link_requantization`: the int8 groups reading its result and how
        # ("input" or "accum"), None where another step reads it; the group making its
        # residual, if one does
        self.readers: list[tuple[Int8Group, str]] | None = None
        self.accum_from: Int8Group | None = None
        self._run = build(*_PROVISIONAL, None, None)

    def start_calibration(self) -> None:
        self.state = "calibrating"
        self._run = None

    def fix_scales(self) -> None:
        self.qparams = self.input_range.qparams()
        if self.sums:
            self.accum_qparams = self.accum_range.qparams()

    def readers_qparams(self) -> tuple[float, int] | None:
        """The one scale and zero point its readers take its result at, if they agree."""
        found = {r.qparams if role == "input" else r.accum_qparams
                 for r, role in self.readers or ()}
        return found.pop() if len(found) == 1 else None

    def finish(self, requantize: tuple[float, int] | None, accum_in_uint8: bool) -> None:
        """Build the int8 function, writing uint8 at `requantize` if given."""
        self.requantize, self.accum_in_uint8 = requantize, accum_in_uint8
        self._run = self.build(*self.qparams, requantize,
                               self.accum_qparams if accum_in_uint8 else None)
        self.fp32 = None
        self.state = "ready"

    def __call__(self, x, *rest):
        if self.state == "calibrating":
            self.input_range.observe(x)
            if self.sums:
                self.accum_range.observe(rest[0])
            return self.fp32(x, *rest)
        return self._run(x, *rest)


def decide_uint8(groups: list[Int8Group]) -> set[Int8Group]:
    """The groups that write uint8 codes (after every group fixed its scales): those whose
    every reader is an int8 group taking the result at one scale, where, for a convolution
    summing into its residual, the residual arrives in uint8 too, since its result keeps
    the residual's type (and the other way round: a residual in uint8 only for a group
    that then writes uint8). ResNet's last stage stays float32, its output going to the
    average pooling; the stages before it run uint8 end to end."""
    writes = {g for g in groups if g.requantizes and g.readers_qparams() is not None}
    changed = True
    while changed:
        changed = False
        for g in groups:
            if not g.sums:
                continue
            accum = g.accum_from is not None and g.accum_from in writes
            if (g in writes) != accum:
                before = len(writes)
                writes.discard(g)
                writes.discard(g.accum_from)
                changed = changed or len(writes) != before
    return writes


class Calibration:
    """The int8 groups of one executor, and whether they are calibrated. The executor
    hands a call here while they are not (`Executor.__call__`)."""

    def __init__(self, groups: list[Int8Group]):
        self.groups = groups
        self.done = False
        # calls before `done` one at a time: a group switching to int8 (and its producer
        # to writing uint8) while another thread's call runs the graph would mix the two
        self._lock = threading.Lock()

    def call(self, run: Callable, inputs):
        """A call before calibration finished: observed. Inside `calibrating`, that is all;
        outside (nothing was given to calibrate on), calibration finishes on this call and
        it runs again in int8, so every call's results come from the int8 graph."""
        with self._lock:
            if self.done:  # another thread's call finished it meanwhile
                return run(inputs)
            outputs = run(inputs)
            session = _session.get()
            if session is not None:
                session[id(self)] = self
                return outputs
            self._finish()
        return run(inputs)

    def finish(self) -> None:
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        if self.done:
            return
        for g in self.groups:
            g.fix_scales()
        writes = decide_uint8(self.groups)
        for g in self.groups:
            g.finish(g.readers_qparams() if g in writes else None,
                     g.sums and g.accum_from in writes)
        self.done = True


_session: ContextVar[dict | None] = ContextVar("opweave_int8_calibration", default=None)


@contextmanager
def calibrating():
    """Calls made meanwhile (in this thread) calibrate the int8 groups they reach, also
    those of plans built during them; leaving without an error fixes their scales, and
    they compute in int8 from then on."""
    session: dict = {}
    token = _session.set(session)
    try:
        yield
    finally:
        _session.reset(token)
    for calibration in session.values():
        calibration.finish()


def link_requantization(steps, graph_outputs) -> int:
    """Record which int8 groups read each int8 group's result, and how: as their input
    (first operand) or as the residual a convolution sums into (second), directly or
    through single view ops; a result any other step reads, or a graph output, keeps
    `readers` None and stays float32. Also each summing group's residual maker.
    `decide_uint8` picks, once scales are known, which results travel as uint8 codes.
    Returns the number of groups all of whose readers are int8 groups."""
    readers: dict = {}
    made_by: dict = {}
    for step in steps:
        for i, v in enumerate(step.inputs):
            readers.setdefault(v, []).append((step, i))
        for v in step.outputs:
            made_by[v] = step
    outputs = set(graph_outputs)

    def is_view(step) -> bool:
        return step.kind == "op" and len(step.nodes) == 1 and step.nodes[0].opdef.is_view

    def int8_uses(v, found) -> bool:
        uses = readers.get(v)
        if not uses or v in outputs:
            return False
        for r, i in uses:
            if isinstance(r.fn, Int8Group) and (i == 0 or (i == 1 and r.fn.sums)):
                found.append((r.fn, "input" if i == 0 else "accum"))
            elif not (is_view(r) and all(int8_uses(o, found) for o in r.outputs)):
                return False
        return True

    def maker(v):
        step = made_by.get(v)
        while step is not None and is_view(step):
            step = made_by.get(step.inputs[0])
        return step.fn if step is not None and isinstance(step.fn, Int8Group) else None

    linked = 0
    for step in steps:
        group = step.fn
        if not isinstance(group, Int8Group):
            continue
        if group.sums:
            group.accum_from = maker(step.inputs[1])
        found: list = []
        if len(step.outputs) == 1 and int8_uses(step.outputs[0], found):
            group.readers = found
            linked += 1
    return linked
