"""Generated kernels for single ops whose torch kernel is slow at the sizes models use.

`adaptive_max_pool2d` (XML-CNN's dynamic max pooling): torch's CPU kernel costs tens of
microseconds on a [1, 32, 1, 493] input that a loop reads in one or two, because it
computes the indices too and opens a parallel region per call. `max_pool2d` (ResNet's
3x3/2 pooling of a channels-last [1, 64, 112, 112]): torch takes 230 us standalone and
about 460 us in the model (3.2 ms on a row-major input). Both pool over windows that
depend only on the shapes, so their bounds are constant tables here (a max pooling's
padding is a window clipped to the input: a padded position never wins). NaN propagates
as in torch (a NaN in a window is its maximum), through a flag beside the maximum so the
window loop vectorizes. Each kernel also has a bfloat16 form, for a bf16 step's result
that only bf16 steps read after it (codegen/precision.hand_off_in_bf16): picking a
maximum is exact in any type, so it computes the float32 form's result, rounded, without
the widened copy (ResNet-50's pooling: 81 against 115-117 us for float32 alone, 167-199
with the conversions, on the Zen 4).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..ir import Node
from .render import KernelSource

PARALLEL_ROWS = 256  # (batch x channel) rows from which the kernel runs on the team
PARALLEL_ELEMENTS = 1 << 16  # or input elements from which it does
MAX_STACK_COLUMNS = 8192  # the row-major kernel's column maxima (5 bytes each) on the stack
MAX_STACK_CHANNELS = 4096  # the channels-last kernel keeps 5 bytes per channel on the stack


def _windows(size: int, out: int) -> tuple[list[int], list[int]]:
    starts = [(i * size) // out for i in range(out)]
    ends = [-(-((i + 1) * size) // out) for i in range(out)]
    return starts, ends


def adaptive_max_pool(node: Node) -> KernelSource | None:
    """The kernel for one `adaptive_max_pool2d` without indices on float32, or None."""
    if node.op != "adaptive_max_pool2d" or node.attrs.get("with_indices"):
        return None
    x = node.inputs[0]
    if x.type.dtype != torch.float32 or x.type.numel == 0 or len(x.type.shape) < 3:
        return None
    *_, height, width = x.type.shape
    oh, ow = node.attrs["output_size"]
    return _max_pool_kernel(node, *_windows(height, oh), *_windows(width, ow),
                            channels_last_out=False)


def max_pool(node: Node) -> KernelSource | None:
    """The kernel for one `max_pool2d` without indices or dilation on a 4-D float32, or
    None. Its channels-last form writes a channels-last output, as the convolution after
    it reads."""
    attrs = node.attrs
    if node.op != "max_pool2d" or attrs["with_indices"] or tuple(attrs["dilation"]) != (1, 1):
        return None
    x, y = node.inputs[0], node.outputs[0]
    if x.type.dtype != torch.float32 or x.type.numel == 0 or len(x.type.shape) != 4:
        return None
    bounds = [_clipped(size, out, k, s, p) for size, out, k, s, p in
              zip(x.type.shape[2:], y.type.shape[2:], attrs["kernel"], attrs["stride"],
                  attrs["padding"])]
    return _max_pool_kernel(node, *bounds[0], *bounds[1], channels_last_out=True)


def _clipped(size: int, out: int, kernel: int, stride: int, pad: int):
    """Each output position's window [start, end) along one axis, clipped to the input."""
    starts = [i * stride - pad for i in range(out)]
    return [max(0, a) for a in starts], [min(size, a + kernel) for a in starts]


@dataclass(frozen=True)
class _Element:
    """How a body reads, compares and writes its tensors' elements: float32 as they are,
    or bfloat16 as 16-bit integer keys in the order of the values they stand for (a
    negative value's magnitude bits flipped; the mapping is its own inverse), so that a
    vector register compares twice the elements float32's does and nothing is widened.
    A NaN is flagged beside the maximum and stored as each type's quiet NaN (what
    rounding float32's NAN to bf16 gives). The bf16 body's maximum is the float32 body's
    on the widened input, except that where a window holds both zeros +0 wins (in
    float32 either may)."""

    ctype: str   # of the tensors' elements
    acc: str     # of the running maximum
    lowest: str  # below every value
    key: str     # the comparable form of the element `{0}`
    is_nan: str  # whether the element `{0}` is a NaN
    value: str   # the element the maximum `{0}` stands for
    nan: str     # the NaN stored
    suffix: str  # of the function's name


FLOAT32 = _Element("float", "float", "-INFINITY", "{0}", "{0} != {0}", "{0}", "NAN", "")
BF16 = _Element("uint16_t", "int16_t", "INT16_MIN", "ow_bf16_key({0})",
                "(({0}) & 0x7FFF) > 0x7F80", "(uint16_t)ow_bf16_key({0})", "(uint16_t)0x7FC0",
                "_bf16")


def _max_pool_kernel(node: Node, hs, he, ws, we, channels_last_out: bool) -> KernelSource:
    """Max pooling of `node`'s input over the windows [hs, he) x [ws, we): a row-major
    body, and a channels-last one where the input has 4 dimensions and few channels; each
    once more on bfloat16 (`_Element`: for a bf16 step's result, whose readers are bf16
    steps too, codegen/precision.hand_off_in_bf16)."""
    x, y = node.inputs[0], node.outputs[0]
    *lead, height, width = x.type.shape
    bodies = {e: (_row_major_pool(lead, height, width, hs, he, ws, we, e),
                  _channels_last_pool(lead, height, width, hs, he, ws, we, e, channels_last_out))
              for e in (FLOAT32, BF16)}
    digest = hashlib.sha256("\n".join(line for pair in bodies.values() for lines in pair
                                      for line in lines).encode()).hexdigest()[:16]
    name = f"ow_p_{digest}"
    body, defined = "", set()
    for e, (lines, cl_lines) in bodies.items():
        for fn, fn_lines in ((f"{name}{e.suffix}", lines), (f"{name}_cl{e.suffix}", cl_lines)):
            if fn_lines:
                body += f'extern "C" void {fn}(void** args) {{\n' + "\n".join(fn_lines) + "\n}\n"
                defined.add(fn)
    line = next(i for i, text in enumerate(body.splitlines(), 1) if "o[i *" in text)
    cl_name, cl_bf16 = (n if n in defined else None for n in (f"{name}_cl", f"{name}_cl_bf16"))
    # other layouts run torch's kernel: quicker than a copy and this loop
    return KernelSource(name, body, [x], [y], False, {node: line}, contiguous_only=True,
                        channels_last_name=cl_name,
                        channels_last_out=cl_name is not None and channels_last_out,
                        bf16_names=(f"{name}{BF16.suffix}", cl_bf16))


def _row_major_pool(lead, height, width, hs, he, ws, we, e: _Element) -> list[str]:
    """The body over a row-major input. Per output row, the maxima down each column of
    its window's rows first (a vectorized loop along the contiguous row), then each
    output's maximum across its window's columns of those: a loop over the few elements
    of one window's row, vectorized (with its reduction's set-up and tail) per window,
    took 5 ns an element (Inception-v3's 3x3/2 pooling of [1, 64, 147, 147]: 15.7 ms,
    against torch's 6.2). The column maxima live on the stack, or on the heap for rows
    wider than `MAX_STACK_COLUMNS`."""
    oh, ow = len(hs), len(ws)
    rows = math.prod(lead)
    columns = ([f"    {e.acc} column[{width}];", f"    unsigned char column_nan[{width}];"]
               if width <= MAX_STACK_COLUMNS else
               [f"    std::vector<{e.acc}> column({width});",
                f"    std::vector<unsigned char> column_nan({width});"])
    return [
        *_pointers_and_windows(hs, he, ws, we, e),
        *_team_pragma(rows, rows, rows * height * width),
        f"  for (int64_t r = 0; r < {rows}; ++r) {{",
        f"    const {e.ctype}* plane = in + r * {height * width};",
        f"    {e.ctype}* o = out + r * {oh * ow};",
        *columns,
        f"    for (int64_t i = 0; i < {oh}; ++i) {{",
        "      #pragma omp simd",
        f"      for (int64_t w = 0; w < {width}; ++w) {{ column[w] = {e.lowest}; column_nan[w] = 0; }}",
        "      for (int64_t h = hs[i]; h < he[i]; ++h) {",
        f"        const {e.ctype}* line = plane + h * {width};",
        "        #pragma omp simd",
        f"        for (int64_t w = 0; w < {width}; ++w) {{",
        f"          const {e.acc} v = {e.key.format('line[w]')};",
        "          column[w] = v > column[w] ? v : column[w];",
        f"          column_nan[w] |= {e.is_nan.format('line[w]')};",
        "        }",
        "      }",
        f"      for (int64_t j = 0; j < {ow}; ++j) {{",
        f"        {e.acc} m = {e.lowest};",
        "        int nan = 0;",
        "        for (int64_t w = ws[j]; w < we[j]; ++w) {",
        "          m = column[w] > m ? column[w] : m;",
        "          nan |= column_nan[w];",
        "        }",
        f"        o[i * {ow} + j] = nan ? {e.nan} : {e.value.format('m')};",
        "      }",
        "    }",
        "  }",
    ]


def _team_pragma(shares: int, rows: int, elements: int) -> list[str]:
    """The pragma that shares a body's loop of `shares` iterations among the team, where
    there is more than one and the pooling has the (batch x channel) rows or the input
    elements to pay for entering a parallel region (about a microsecond)."""
    if shares < 2 or (rows < PARALLEL_ROWS and elements < PARALLEL_ELEMENTS):
        return []
    return ["  #pragma omp parallel for num_threads(ow_team())"]


def _pointers_and_windows(hs, he, ws, we, e: _Element) -> list[str]:
    """Both bodies' first lines: the output and input pointers, the windows' bounds."""
    def table(name, values):
        return f"  static const int64_t {name}[{len(values)}] = {{{', '.join(map(str, values))}}};"
    return [f"  {e.ctype}* __restrict out = ({e.ctype}*)args[0];",
            f"  const {e.ctype}* __restrict in = (const {e.ctype}*)args[1];",
            table("hs", hs), table("he", he), table("ws", ws), table("we", we)]


def _channels_last_pool(lead, height, width, hs, he, ws, we, e: _Element,
                        channels_last_out: bool = False) -> list[str]:
    """The body of the same pooling over a channels-last [N, C, H, W] input (a 1-D
    convolution's output run as 2-D is one: XML-CNN's), writing a row-major output, or a
    channels-last one with `channels_last_out`.
    Each window's pixels are read as rows of C channels, its maxima kept per channel, so
    the inner loop runs over contiguous channels. Empty for inputs that are not 4-D, and
    for channel counts whose per-channel maxima would not fit the stack comfortably."""
    if len(lead) != 2 or lead[1] > MAX_STACK_CHANNELS:
        return []
    n, c = lead
    oh, ow = len(hs), len(ws)
    windows = n * oh * ow
    parallel = _team_pragma(windows, n * c, n * c * height * width)
    stored = f"nan[ch] ? {e.nan} : {e.value.format('m[ch]')}"
    return [
        *_pointers_and_windows(hs, he, ws, we, e),
        *parallel,
        f"  for (int64_t k = 0; k < {windows}; ++k) {{",
        f"    const int64_t b = k / {oh * ow}, i = (k / {ow}) % {oh}, j = k % {ow};",
        f"    const {e.ctype}* image = in + b * {height * width * c};",
        f"    {e.acc} m[{c}];",
        f"    unsigned char nan[{c}];",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) {{ m[ch] = {e.lowest}; nan[ch] = 0; }}",
        "    for (int64_t h = hs[i]; h < he[i]; ++h) {",
        "      for (int64_t w = ws[j]; w < we[j]; ++w) {",
        f"        const {e.ctype}* pixel = image + (h * {width} + w) * {c};",
        "        #pragma omp simd",
        f"        for (int64_t ch = 0; ch < {c}; ++ch) {{",
        f"          const {e.acc} v = {e.key.format('pixel[ch]')};",
        "          m[ch] = v > m[ch] ? v : m[ch];",
        f"          nan[ch] |= {e.is_nan.format('pixel[ch]')};",
        "        }",
        "      }",
        "    }",
    ] + ([
        f"    {e.ctype}* o = out + k * {c};",
        "    #pragma omp simd",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) o[ch] = {stored};",
    ] if channels_last_out else [
        f"    {e.ctype}* o = out + b * {c * oh * ow} + i * {ow} + j;",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) o[ch * {oh * ow}] = {stored};",
    ]) + [
        "  }",
    ]


TEMPLATES = (adaptive_max_pool, max_pool)


def render_single(node: Node) -> KernelSource | None:
    """A generated kernel for `node` alone, where a template covers it."""
    for template in TEMPLATES:
        src = template(node)
        if src is not None:
            return src
    return None
