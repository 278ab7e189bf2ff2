"""Convolutions and linear layers on oneDNN's own library, called directly: the library
form "onednn-direct".

torch runs them (`mkldnn._convolution_pointwise`, `mkldnn._linear_pointwise`) on the
oneDNN built into it, and builds oneDNN's primitive descriptor again at every call. Here
each one's primitive is made once, with its weights reordered into the layout it asked
for, from oneDNN's GNU OpenMP build on the package index (`onednn-cpu-gomp`, loaded beside
torch: torch keeps its oneDNN's symbols to itself, and both share torch's libgomp, so one
thread team). A call wraps the caller's pointers and runs; a native plan calls it as a raw
function. Whether it runs is still a measured choice per shape (`choice.choose`), against
torch's forms; docs/tuning.md has the measurements.

`onednn_direct.cpp` is built once per machine into opweave's cache, like the native
runtime (content hash checked before it is loaded). Where the library or its headers are
missing (another platform) or it cannot be built, the form is not offered, and one
warning says why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
import warnings
import weakref
from typing import NamedTuple
from pathlib import Path

import torch

from ..files import cache_root
from . import build

SOURCE = Path(__file__).with_name("onednn_direct.cpp")
# Winograd convolutions, compiled in the same module (the same oneDNN, the same helpers)
WINOGRAD_SOURCE = Path(__file__).with_name("onednn_winograd.cpp")
# attention head by head on oneDNN's sgemm, or its bf16 matmul (codegen/attention.py's
# "per-head" and "per-head-bf16" forms)
ATTENTION_SOURCE = Path(__file__).with_name("onednn_attention.cpp")
FORMAT = 1
# epilogue codes of `ow_onednn_conv_create`
UNARY = {None: 0, "relu": 1, "tanh": 2, "sigmoid": 3, ("gelu", "none"): 4, ("gelu", "tanh"): 5,
         ("clamp", 0.0, 6.0): 6}  # ReLU6
NO_BINARY, SUM_IN_PLACE, ADD = 0, 1, 2


class ReferenceOnly(RuntimeError):
    """oneDNN has only its reference implementation for this primitive here (orders of
    magnitude slower than torch's forms): the caller runs another form instead."""


class OneDNNWarning(UserWarning):
    """oneDNN's own library cannot be used: convolutions and linear layers run through
    torch's oneDNN."""


_lock = threading.Lock()
_making = threading.Lock()
_library: ctypes.CDLL | None = None
_problem: str | None = None


def _prefix() -> Path:
    """Where the library (lib/libdnnl.so.3) and its headers (include/) are:
    `$OPWEAVE_ONEDNN_ROOT`, else the environment's prefix, where pip puts the files of
    the `onednn-cpu-gomp` and `onednn-devel-cpu-gomp` wheels."""
    return Path(os.environ.get("OPWEAVE_ONEDNN_ROOT") or sys.prefix)


def _locate() -> tuple[Path, str, list[str], list[str], str]:
    """(the object's path in the cache, its key, compiler flags, link flags, the source);
    the source is read once, so the key always names the text that is compiled."""
    include, lib = _prefix() / "include", _prefix() / "lib"
    header, shared = include / "oneapi" / "dnnl" / "dnnl.hpp", lib / "libdnnl.so.3"
    for needed in (header, shared):
        if not needed.exists():
            raise build.BuildError(f"oneDNN's library is not installed ({needed} is missing; "
                                   f"it comes with the onednn-cpu-gomp and "
                                   f"onednn-devel-cpu-gomp packages)")
    source = "\n".join(path.read_text() for path in (SOURCE, WINOGRAD_SOURCE, ATTENTION_SOURCE))
    # -fopenmp: omp_get_max_threads, from the libgomp torch and oneDNN share; -O3 and
    # -march=native vectorize bf16x3's split (so the key names the CPU's features)
    flags = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp",
             f"-I{include}"]
    libraries = [f"-L{lib}", "-l:libdnnl.so.3", f"-Wl,-rpath,{lib}"]
    stamp = f"{shared.resolve().name}:{shared.stat().st_size}"
    parts = [source, build.compiler_version(), " ".join(flags + libraries), stamp, str(FORMAT),
             build.cpu_features()]
    key = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
    flags.append(f'-DOPWEAVE_ONEDNN_KEY="{key}"')
    path = cache_root() / "onednn-v1" / f"onednn_direct-{key}.so"
    return path, key, flags, libraries, source


def _load() -> ctypes.CDLL:
    path, key, flags, libraries, source = _locate()
    build.trusted_object(source, path, flags, libraries)
    lib = ctypes.CDLL(str(path))
    lib.ow_key.restype = ctypes.c_char_p
    if lib.ow_key().decode() != key:
        build.move_aside(path, "identifies itself with another key")
        raise build.BuildError(f"{path} is not the oneDNN module it should be")
    lib.ow_onednn_variants.argtypes = [ctypes.c_void_p]
    made = [ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int]  # geometry, weight, bias, unary, binary, mode
    for create in (lib.ow_onednn_conv_create, lib.ow_onednn_linear_create):
        create.restype = ctypes.c_void_p
        create.argtypes = made + [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.ow_winograd_create.restype = ctypes.c_void_p
    lib.ow_winograd_create.argtypes = made + [ctypes.c_char_p, ctypes.c_int]
    lib.ow_onednn_impl.restype = ctypes.c_char_p
    lib.ow_onednn_impl.argtypes = [ctypes.c_void_p]
    lib.ow_onednn_destroy.argtypes = [ctypes.c_void_p]
    lib.ow_onednn_run.argtypes = [ctypes.c_void_p]
    lib.ow_winograd_run.argtypes = [ctypes.c_void_p]
    lib.ow_winograd_fallbacks.restype = ctypes.c_int64
    lib.ow_winograd_fallbacks.argtypes = [ctypes.c_void_p]
    lib.ow_attention_create.restype = ctypes.c_void_p
    lib.ow_attention_create.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_float,
                                        ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.ow_attention_destroy.argtypes = [ctypes.c_void_p]
    lib.ow_attention_run.argtypes = [ctypes.c_void_p]
    lib.ow_attention_impl.restype = ctypes.c_char_p
    lib.ow_attention_impl.argtypes = [ctypes.c_void_p]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded module (built here the first time on this machine, about 2 s), or None
    when it cannot be (`unavailable()` says why; one OneDNNWarning said so)."""
    global _library, _problem
    with _lock:
        if _library is None and _problem is None:
            try:
                _library = _load()
            except (build.BuildError, OSError, AttributeError) as err:
                _problem = str(err)
                warnings.warn(f"opweave: convolutions and linear layers run through torch's "
                              f"oneDNN only: {err}", OneDNNWarning, stacklevel=2)
        return _library


def unavailable() -> str | None:
    return _problem


@functools.lru_cache(maxsize=1)
def bf16x3_problem() -> str | None:
    """Why oneDNN cannot compute bf16x3 products here (None: it can): a CPU without
    AVX-512 has no bf16 primitives in oneDNN 3.2, and its reference ones would be 100-1000x
    slower than float32. Probed once, on a small product."""
    return _probe(torch.zeros(8, 4), parts=3)


@functools.lru_cache(maxsize=1)
def bf16_problem() -> str | None:
    """Why oneDNN cannot compute products in bf16 here (None: it can), as for
    `bf16x3_problem`: precision "bf16" then runs on torch's oneDNN forms only."""
    return _probe(torch.zeros(8, 4), low=True)


@functools.lru_cache(maxsize=1)
def int8_problem() -> str | None:
    """Why oneDNN cannot compute products in int8 here (None: it can), as for
    `bf16x3_problem`: precision "int8" then runs on torch's oneDNN int8 forms only."""
    return _probe(torch.zeros(8, 4, dtype=torch.int8),
                  quant=Int8Quantization(1.0, 0, torch.ones(4)))


def _probe(weight: torch.Tensor, **form) -> str | None:
    """Why a small product [4, 8] x `weight` in this form (`DirectLinear`'s keywords)
    cannot be made and run here, or None."""
    if library() is None:
        return f"oneDNN's library is unavailable: {unavailable()}"
    probe = DirectLinear((4, 8, 4), weight, None, **form)
    try:
        probe(torch.zeros(4, 8, dtype=probe.dtype))
    except (RuntimeError, ReferenceOnly) as err:
        return str(err)
    return None


def bf16_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bfloat16 tensors whose float32 sum is `x` to float32's precision: each the
    rounded rest of the ones before (an infinite or NaN value is all in its first part)."""
    found = []
    rest = x.to(torch.float32)
    for _ in range(3):
        part = rest.to(torch.bfloat16)
        found.append(part)
        wide = part.float()
        rest = torch.where(torch.isfinite(wide), rest - wide, torch.zeros_like(rest))
    return found[0], found[1], found[2]


def bf16x3_weight(weight: torch.Tensor, axis: int) -> torch.Tensor:
    """A weight's bf16 parts in the slots [w0 w1 w2 w0 w1 w0] along its reduction axis,
    against the source's [x2 x1 x0 x1 x0 x0] (onednn_direct.cpp): the six cross products
    with i + j <= 2, float32's accuracy (Henry, Tang and Heinecke, ARITH'19), smallest
    first."""
    w0, w1, w2 = bf16_parts(weight)
    # an infinite or NaN weight only meets the source's first part (as x0 meets only w0 in
    # onednn_direct.cpp): against x1 or x2, often 0, it would make NaN where float32 has inf
    crossed = torch.where(torch.isfinite(w0), w0, torch.zeros_like(w0))
    return torch.cat([crossed, w1, w2, crossed, w1, w0], dim=axis).contiguous()


class Int8Quantization(NamedTuple):
    """How an int8 primitive (mode 4) reads and writes: its source's uint8 codes at
    (`scale`, `zero_point`); its weight's scale per output channel (the weight itself
    given as int8); its result as uint8 codes at `out` = (scale, zero point), or float32
    where None; a convolution's residual, summed in place, as codes at `accum` (where
    `out` is given: the sum keeps the residual's type), or float32 where None. `dynamic`:
    the source's scale and zero point come with each call instead (a linear layer's,
    dynamic quantization; its result is float32)."""

    scale: float
    zero_point: int
    weight_scales: torch.Tensor
    out: tuple[float, int] | None = None
    accum: tuple[float, int] | None = None
    dynamic: bool = False

    def packed(self) -> torch.Tensor:
        """The create functions' `quant` array (onednn_direct.cpp's `Quantization`)."""
        if self.accum is not None and self.out is None:
            raise ValueError("an int8 sum into codes writes codes")
        out, accum = self.out or (1.0, 0), self.accum or (1.0, 0)
        flags = float((self.out is not None) | 2 * self.dynamic)
        head = [self.scale, self.zero_point, *out, flags, *accum]
        return torch.cat([torch.tensor(head, dtype=torch.float32),
                          self.weight_scales.to(torch.float32).reshape(-1)]).contiguous()


class _Direct:
    """One primitive, made at its first call from the weights it was given (then let go:
    they are packed inside it). Calls report themselves to a native plan's recorder like a
    generated kernel (`CppKernel.recording`): output, input, the primitive's address as a
    constant int64 tensor, then the residual operand if any."""

    kind = ""  # "conv" | "linear" | "Winograd conv", for messages
    creator, runner = "", "ow_onednn_run"  # the module's functions that make and run it
    quantizes = True  # whether the create function takes int8's `quant` (mode 4)
    reduction_axis = 0  # the weight's axis its source's values are summed against

    def __init__(self, geometry, weight: torch.Tensor, bias: torch.Tensor | None,
                 unary, binary: int, parts: int = 1, low: bool = False,
                 quant: Int8Quantization | None = None):
        if parts not in (1, 3) or ((low or quant) and parts != 1) or (low and quant):
            raise ValueError(f"a direct oneDNN {self.kind} computes from 1 or 3 parts, "
                             f"in bf16 or int8 from 1, not {parts}, and not in both")
        self.geometry = tuple(int(g) for g in geometry)
        # low: operands, result and residual in bfloat16 (precision "bf16"), else float32
        self.low, self.dtype = low, torch.bfloat16 if low else torch.float32
        # int8: uint8 source codes, and a result (and a residual) of codes or float32
        self.quant = quant
        self.result_dtype = self.residual_dtype = self.dtype
        if quant is not None:
            self._check_quantization(quant, binary)
            self.dtype = torch.uint8
            self.result_dtype = torch.uint8 if quant.out is not None else torch.float32
            self.residual_dtype = torch.uint8 if quant.accum is not None else torch.float32
        # as given (a view of the graph's constant): made contiguous only when packed
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self.unary, self.binary, self.parts = UNARY[unary], binary, parts
        self._handle: int | None = None
        self._context: torch.Tensor | None = None

    def _outputs(self) -> int:
        """Its output channels (a convolution's) or columns (a product's)."""
        raise NotImplementedError

    def _check_quantization(self, quant: Int8Quantization, binary: int) -> None:
        """Refuses what the primitive would misread: a scale per output channel missing,
        or a sum in place into a residual of another type than the result (oneDNN's sum
        keeps the destination's type)."""
        if quant.weight_scales.numel() != self._outputs():
            raise ValueError(f"an int8 {self.kind} with {self._outputs()} outputs got "
                             f"{quant.weight_scales.numel()} weight scales")
        if binary == SUM_IN_PLACE and (quant.out is None) != (quant.accum is None):
            raise ValueError(f"an int8 {self.kind} summing in place writes its residual's "
                             "type: codes in and out, or float32 in and out")

    def _create(self) -> None:
        lib = library()
        with _making:  # two threads making the first call: one primitive
            if self._handle is None:
                self._make(lib)

    def _make(self, lib: ctypes.CDLL | None) -> None:
        if lib is None:
            raise RuntimeError(f"oneDNN's library is unavailable: {unavailable()}")
        error = ctypes.create_string_buffer(512)
        create = getattr(lib, self.creator)
        weight, geometry = self._library_weight(), self._library_geometry()
        bias = None if self.bias is None else self.bias.to(torch.float32).contiguous()
        packed = None if self.quant is None else self.quant.packed()  # alive for the call
        quant = [None if packed is None else packed.data_ptr()] if self.quantizes else []
        handle = create((ctypes.c_int64 * len(geometry))(*geometry),
                        weight.data_ptr(), None if bias is None else bias.data_ptr(),
                        self.unary, self.binary, self._mode(), *quant, error, len(error))
        if not handle:
            raise RuntimeError(f"oneDNN refused the {self.kind} {self.geometry}: "
                               f"{error.value.decode(errors='replace')}")
        implementation = lib.ow_onednn_impl(handle).decode()
        if implementation.startswith("ref"):
            lib.ow_onednn_destroy(handle)
            raise ReferenceOnly(f"oneDNN has only its reference {self.kind} for "
                                f"{self.geometry} here ({implementation})")
        self._context = torch.tensor([handle], dtype=torch.int64, device="cpu")
        self._lib = lib
        self._runner = getattr(lib, self.runner)
        weakref.finalize(self, lib.ow_onednn_destroy, handle)
        self.weight = self.bias = None
        self._handle = handle  # last: a caller that sees it sees the rest

    def _library_weight(self) -> torch.Tensor:
        """The weight as the module's create function reads it."""
        if self.quant is not None:
            if self.weight.dtype != torch.int8:
                raise ValueError(f"an int8 {self.kind} takes an int8 weight, not {self.weight.dtype}")
            return self.weight.contiguous()
        if self.low:
            return self.weight.to(torch.bfloat16).contiguous()
        weight = self.weight.to(torch.float32).contiguous()
        return bf16x3_weight(weight, self.reduction_axis) if self.parts == 3 else weight

    def _library_geometry(self) -> tuple[int, ...]:
        return self.geometry

    def _mode(self) -> int:
        """The create function's last integer: 1 float32, 2 bf16, 3 bf16x3, 4 int8."""
        return 4 if self.quant is not None else 2 if self.low else self.parts

    def implementation(self) -> str:
        """oneDNN's name for the kernel it runs (made at the first call)."""
        if self._handle is None:
            self._create()
        return self._lib.ow_onednn_impl(self._handle).decode()

    def variants(self) -> int:
        """How many primitives were made for thread counts other than the first call's."""
        return self._lib.ow_onednn_variants(self._handle) if self._handle else 0

    def _call(self, out: torch.Tensor, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        if self._handle is None:
            self._create()
        run_recorded(self._runner, [out, x, self._context, *extra])
        return out

    def _checked(self, t: torch.Tensor, shape, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.dtype
        if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu":
            want = str(dtype).removeprefix("torch.")
            raise ValueError(f"a direct oneDNN {self.kind} built for {shape} {want} on the "
                             f"CPU got {tuple(t.shape)} {t.dtype} on {t.device}")


def run_recorded(runner, tensors: list[torch.Tensor]) -> None:
    """Calls the module's raw function `runner` (`void f(void**)`) on the tensors'
    pointers, and reports the call to a native plan's recorder where one listens
    (`CppKernel.recording`), so that the plan calls it itself."""
    runner((ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors)))
    from .lower import CppKernel  # a native plan's recorder listens there
    if CppKernel.recording is not None:
        CppKernel.recording(ctypes.cast(runner, ctypes.c_void_p).value, tensors)


class DirectConv(_Direct):
    """A convolution, NHWC float32 in and out (bf16 where `low`).

    `geometry`: (N, C, H, W, O, KH, KW, groups, stride h, w, padding h, w, dilation h, w),
    then optionally the padding after, h, w, where it differs from the padding before
    (zero padding written out before the convolution: `absorbed_padding`).
    `binary`: NO_BINARY, SUM_IN_PLACE (the destination holds the residual on entry) or
    ADD (a residual operand, NHWC like the output)."""

    kind, creator = "conv", "ow_onednn_conv_create"
    reduction_axis = 1  # [O, C/groups, KH, KW]: each group's block of input channels

    def _outputs(self) -> int:
        return self.geometry[4]

    def __init__(self, geometry, weight: torch.Tensor, bias: torch.Tensor | None,
                 unary=None, binary: int = NO_BINARY, parts: int = 1, low: bool = False,
                 quant: Int8Quantization | None = None):
        if quant is not None and quant.dynamic:
            raise ValueError("dynamic int8 quantization is for linear layers, not convolutions")
        if len(geometry) == 14:
            geometry = (*geometry, *geometry[10:12])
        super().__init__(geometry, weight, bias, unary, binary, parts, low, quant)
        n, c, h, w, o, kh, kw, _, sh, sw, ph, pw, dh, dw, ph_after, pw_after = self.geometry
        oh = (h + ph + ph_after - dh * (kh - 1) - 1) // sh + 1
        ow = (w + pw + pw_after - dw * (kw - 1) - 1) // sw + 1
        self.in_shape, self.out_shape = (n, c, h, w), (n, o, oh, ow)

    def _nhwc(self, t: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        self._checked(t, shape, dtype)
        return t.contiguous(memory_format=torch.channels_last)  # a copy only if not already

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution of `x` with its epilogue; with SUM_IN_PLACE, added into
        `residual` (made channels-last first if it is not) and returned; with ADD, a new
        tensor holding the sum."""
        x = self._nhwc(x, self.in_shape)
        if self.binary == SUM_IN_PLACE:
            return self._call(self._nhwc(residual, self.out_shape, self.residual_dtype), x)
        out = torch.empty(self.out_shape, dtype=self.result_dtype, device="cpu",
                          memory_format=torch.channels_last)
        if self.binary == ADD:
            return self._call(out, x, self._nhwc(residual, self.out_shape, self.residual_dtype))
        return self._call(out, x)


def winograd_fits(geometry, unary, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a convolution of `geometry` (as `DirectConv`'s) with activation `unary` has a
    Winograd form: 3x3, stride 1, dilation 1, one group, no activation or relu, and finite
    weights and bias (the weight transform would spread a non-finite one as NaN)."""
    n, c, h, w, o, kh, kw, groups, sh, sw, ph, pw, dh, dw = geometry
    return ((kh, kw, groups, sh, sw, dh, dw) == (3, 3, 1, 1, 1, 1, 1) and ph >= 0 and pw >= 0
            and h + 2 * ph > 2 and w + 2 * pw > 2 and unary in (None, "relu")
            and bool(torch.isfinite(weight).all())
            and (bias is None or bool(torch.isfinite(bias).all())))


class WinogradConv(DirectConv):
    """A 3x3 convolution of stride 1 as Winograd's F(2x2, 3x3) (onednn_winograd.cpp): NHWC
    float32 in and out, the epilogues of `DirectConv` but only relu for an activation. Its
    error is float32's (onednn_winograd.cpp has the measurements; F(4x4, 3x3) was faster
    but not as accurate)."""

    kind, creator, runner = "Winograd conv", "ow_winograd_create", "ow_winograd_run"
    quantizes = False
    tile = 2  # the output tile: the create function's last integer

    def __init__(self, geometry, weight: torch.Tensor, bias: torch.Tensor | None,
                 unary=None, binary: int = NO_BINARY):
        if not winograd_fits(tuple(int(g) for g in geometry), unary, weight, bias):
            raise ValueError(f"no Winograd form for the convolution {tuple(geometry)} with "
                             f"activation {unary} (or its weights are not finite)")
        super().__init__(geometry, weight, bias, unary, binary)

    def _library_geometry(self) -> tuple[int, ...]:
        n, c, h, w, o = self.geometry[:5]
        ph, pw = self.geometry[10:12]
        if tuple(self.geometry[14:16]) != (ph, pw):
            raise ValueError("a Winograd convolution pads equally on both sides")
        return n, c, h, w, o, ph, pw

    def _mode(self) -> int:
        return self.tile

    def fallbacks(self) -> int:
        """How many calls ran the direct convolution (their input was not finite)."""
        return self._lib.ow_winograd_fallbacks(self._handle) if self._handle else 0


@functools.lru_cache(maxsize=1)
def winograd_problem() -> str | None:
    """Why Winograd's form is not offered here (None: it is). Its products are one batched
    matmul, which oneDNN 3.2 runs on its brgemm kernels only with AVX-512; with AVX2 alone
    (measured by holding it to AVX2, `ONEDNN_MAX_CPU_ISA=AVX2`, on the Zen 4) it takes an
    older GEMM, and the form ran 1.8x slower than the direct convolution at ResNet-50's
    56x56 and no faster at 14x14. Probed once, on a small convolution."""
    if library() is None:
        return f"oneDNN's library is unavailable: {unavailable()}"
    probe = WinogradConv((1, 64, 8, 8, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1),
                         torch.zeros(64, 64, 3, 3), None)
    try:
        kernel = probe.implementation()
    except (RuntimeError, ReferenceOnly) as err:
        return str(err)
    return None if kernel.startswith("brg") else \
        f"oneDNN runs its batched products on {kernel}, not its brgemm kernels"


class DirectLinear(_Direct):
    """A product [M, K] x [K, N] with a constant weight, row-major float32 in and out
    (bf16 where `low`).

    `geometry`: (M, K, N); `weight`: [K, N]; `binary`: NO_BINARY or ADD (a residual
    operand [M, N])."""

    kind, creator = "linear", "ow_onednn_linear_create"

    def _outputs(self) -> int:
        return self.geometry[2]

    def __init__(self, geometry, weight: torch.Tensor, bias: torch.Tensor | None,
                 unary=None, binary: int = NO_BINARY, parts: int = 1, low: bool = False,
                 quant: Int8Quantization | None = None):
        super().__init__(geometry, weight, bias, unary, binary, parts, low, quant)
        m, k, n = self.geometry
        self.in_shape, self.out_shape = (m, k), (m, n)

    def _rows(self, t: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        self._checked(t, shape, dtype)
        return t.contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 source_qparams: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """The product of `x` with its epilogue; with ADD, `residual` added. Where the
        source is quantized dynamically, `source_qparams` are its scale (a float32 scalar)
        and zero point (an int64 scalar), as `quantize.DynamicQuantizer` makes them."""
        out = torch.empty(self.out_shape, dtype=self.result_dtype, device="cpu")
        x = self._rows(x, self.in_shape)
        extra = list(self._source_qparams(source_qparams))
        if self.binary == ADD:
            extra.append(self._rows(residual, self.out_shape, self.residual_dtype))
        return self._call(out, x, *extra)

    def _source_qparams(self, given) -> tuple[torch.Tensor, ...]:
        dynamic = self.quant is not None and self.quant.dynamic
        if (given is not None) != dynamic:
            raise ValueError(f"a direct oneDNN linear takes the source's scale and zero point "
                             f"{'with each call' if dynamic else 'only where quantized dynamically'}")
        if given is None:
            return ()
        scale, zero_point = given
        if scale.dtype != torch.float32 or zero_point.dtype != torch.int64 \
                or scale.numel() != 1 or zero_point.numel() != 1:
            raise ValueError(f"a dynamic source's scale and zero point are one float32 and one "
                             f"int64, not {scale.dtype} {tuple(scale.shape)} and "
                             f"{zero_point.dtype} {tuple(zero_point.shape)}")
        return scale, zero_point
