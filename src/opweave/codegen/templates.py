"""Generated kernels for single ops whose torch kernel is slow at the sizes models use.

`adaptive_max_pool2d` (XML-CNN's dynamic max pooling): torch's CPU kernel costs tens of
microseconds on a [1, 32, 1, 493] input that a loop reads in one or two, because it
computes the indices too and opens a parallel region per call. `max_pool2d` (ResNet's
3x3/2 pooling of a channels-last [1, 64, 112, 112]): torch takes 230 us standalone and
about 460 us in the model (3.2 ms on a row-major input). Both pool over windows that
depend only on the shapes, so their bounds are constant tables here (a max pooling's
padding is a window clipped to the input: a padded position never wins). NaN propagates
as in torch (a NaN in a window is its maximum), through a flag beside the maximum so the
window loop vectorizes.
"""
from __future__ import annotations

import hashlib
import math

import torch

from ..ir import Node
from .render import KernelSource

PARALLEL_ROWS = 256  # (batch x channel) rows below which the kernel runs on one thread
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


def _max_pool_kernel(node: Node, hs, he, ws, we, channels_last_out: bool) -> KernelSource:
    """Max pooling of `node`'s input over the windows [hs, he) x [ws, we): a row-major
    body, and a channels-last one where the input has 4 dimensions and few channels."""
    x, y = node.inputs[0], node.outputs[0]
    *lead, height, width = x.type.shape
    oh, ow = len(hs), len(ws)
    rows = math.prod(lead)
    # below the threshold no parallel region at all: entering one costs about a microsecond
    parallel = ["  #pragma omp parallel for num_threads(ow_team())"] if rows >= PARALLEL_ROWS else []
    lines = [
        *_pointers_and_windows(hs, he, ws, we),
        *parallel,
        f"  for (int64_t r = 0; r < {rows}; ++r) {{",
        f"    const float* plane = in + r * {height * width};",
        f"    float* o = out + r * {oh * ow};",
        f"    for (int64_t i = 0; i < {oh}; ++i) {{",
        f"      for (int64_t j = 0; j < {ow}; ++j) {{",
        "        float m = -INFINITY;",
        "        int nan = 0;",
        "        for (int64_t h = hs[i]; h < he[i]; ++h) {",
        f"          const float* line = plane + h * {width};",
        "          #pragma omp simd reduction(max:m) reduction(|:nan)",
        "          for (int64_t w = ws[j]; w < we[j]; ++w) {",
        "            m = line[w] > m ? line[w] : m;",
        "            nan |= line[w] != line[w];",
        "          }",
        "        }",
        f"        o[i * {ow} + j] = nan ? NAN : m;",
        "      }",
        "    }",
        "  }",
    ]
    cl_lines = _channels_last_pool(lead, height, width, oh, ow, hs, he, ws, we,
                                   channels_last_out)
    digest = hashlib.sha256("\n".join(lines + cl_lines).encode()).hexdigest()[:16]
    name = f"ow_p_{digest}"
    body = f'extern "C" void {name}(void** args) {{\n' + "\n".join(lines) + "\n}\n"
    line = next(i for i, text in enumerate(body.splitlines(), 1) if "o[i *" in text)
    cl_name = None
    if cl_lines:
        cl_name = f"{name}_cl"
        body += f'extern "C" void {cl_name}(void** args) {{\n' + "\n".join(cl_lines) + "\n}\n"
    # other layouts run torch's kernel: quicker than a copy and this loop
    return KernelSource(name, body, [x], [y], False, {node: line}, contiguous_only=True,
                        channels_last_name=cl_name,
                        channels_last_out=cl_name is not None and channels_last_out)


def _pointers_and_windows(hs, he, ws, we) -> list[str]:
    """Both bodies' first lines: the output and input pointers, the windows' bounds."""
    def table(name, values):
        return f"  static const int64_t {name}[{len(values)}] = {{{', '.join(map(str, values))}}};"
    return ["  float* __restrict out = (float*)args[0];",
            "  const float* __restrict in = (const float*)args[1];",
            table("hs", hs), table("he", he), table("ws", ws), table("we", we)]


def _channels_last_pool(lead, height, width, oh, ow, hs, he, ws, we,
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
    windows = n * oh * ow
    parallel = (["  #pragma omp parallel for num_threads(ow_team())"]
                if n * c >= PARALLEL_ROWS and windows > 1 else [])
    return [
        *_pointers_and_windows(hs, he, ws, we),
        *parallel,
        f"  for (int64_t k = 0; k < {windows}; ++k) {{",
        f"    const int64_t b = k / {oh * ow}, i = (k / {ow}) % {oh}, j = k % {ow};",
        f"    const float* image = in + b * {height * width * c};",
        f"    float m[{c}];",
        f"    unsigned char nan[{c}];",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) {{ m[ch] = -INFINITY; nan[ch] = 0; }}",
        "    for (int64_t h = hs[i]; h < he[i]; ++h) {",
        "      for (int64_t w = ws[j]; w < we[j]; ++w) {",
        f"        const float* pixel = image + (h * {width} + w) * {c};",
        "        #pragma omp simd",
        f"        for (int64_t ch = 0; ch < {c}; ++ch) {{",
        "          m[ch] = pixel[ch] > m[ch] ? pixel[ch] : m[ch];",
        "          nan[ch] |= pixel[ch] != pixel[ch];",
        "        }",
        "      }",
        "    }",
    ] + ([
        f"    float* o = out + k * {c};",
        "    #pragma omp simd",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) o[ch] = nan[ch] ? NAN : m[ch];",
    ] if channels_last_out else [
        f"    float* o = out + b * {c * oh * ow} + i * {ow} + j;",
        f"    for (int64_t ch = 0; ch < {c}; ++ch) o[ch * {oh * ow}] = nan[ch] ? NAN : m[ch];",
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
