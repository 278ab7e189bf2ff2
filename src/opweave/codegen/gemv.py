"""Products of a few rows with a constant weight: the library form "cpp-gemv".

At batch 1 a linear layer is a matrix-vector product: one pass over its weight, bound by
how fast the weight streams in. oneDNN's and MKL's products are built for many rows; at
one row they ran 3-5x below the memory system's rate here (XML-CNN's 512 x 4000 output
layer, 2 Zen 4 threads: 0.31-0.46 ms warm and 1.4-1.6 ms with the weight out of cache,
where summing the same 8 MB takes 0.05 and 0.39 ms). This kernel keeps the weight [N, K],
so each output is one contiguous dot product, splits the outputs between the threads and
vectorizes each dot product: 0.06 ms warm, 0.35 ms from memory. The bias, the residual
add and the activation are applied to each output as it is stored, in the order the
direct oneDNN form's post-ops apply them (codegen/onednn_direct.cpp). Whether it runs is
measured per shape against the other forms (`choice.choose`), like every form.

The kernel is built once per machine into opweave's kernel cache (codegen/build.py), and a
native plan calls it as a raw function.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from . import build
from .onednn_direct import UNARY  # the activation codes `ow_gemv` takes too

# rows up to which the form is offered: each output reads its weight row once per input
# row (from L1 after the first), where a blocked GEMM reuses registers
MAX_ROWS = 16

_GEMV = r"""
static inline float ow_gemv_activation(float v, int64_t unary) {
  switch (unary) {
    case 1: return v > 0.0f ? v : 0.0f;
    case 2: return ow_tanh(v);
    case 3: return ow_sigmoid(v);
    case 4: return 0.5f * v * (1.0f + ow_erf(v * 0.70710678118654752f));
    case 5: return 0.5f * v * (1.0f + ow_tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case 6: return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);  // ReLU6 (NaN stays NaN)
  }
  return v;
}

// args: out [M, N], x [M, K], weight [N, K], bias [N], shape (int64 M, K, N, activation,
// whether a residual follows), then the residual [M, N]
extern "C" void ow_gemv(void** args) {
  float* __restrict out = static_cast<float*>(args[0]);
  const float* __restrict x = static_cast<const float*>(args[1]);
  const float* __restrict weight = static_cast<const float*>(args[2]);
  const float* __restrict bias = static_cast<const float*>(args[3]);
  const int64_t* shape = static_cast<const int64_t*>(args[4]);
  const int64_t m = shape[0], k = shape[1], n = shape[2], unary = shape[3];
  const float* __restrict residual = shape[4] ? static_cast<const float*>(args[5]) : nullptr;
  // one thread for small products: waking the team costs more than it saves there
#pragma omp parallel for schedule(static) num_threads(ow_team()) if (m * k * n >= (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    const float* __restrict row = weight + j * k;
    for (int64_t i = 0; i < m; ++i) {
      const float* __restrict in = x + i * k;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t p = 0; p < k; ++p) acc += row[p] * in[p];
      float v = acc + bias[j];
      if (residual) v += residual[i * n + j];
      out[i * n + j] = ow_gemv_activation(v, unary);
    }
  }
}
"""


@lru_cache(maxsize=1)
def kernel():
    """The built kernel (once per machine, cached like every generated kernel), or None
    where no compiler builds it (one warning; the other forms remain)."""
    found = build.helper_functions(_GEMV, ["ow_gemv"], "the few-row product kernel",
                                   "linear layers at batch 1 run on oneDNN")
    return None if found is None else found["ow_gemv"]


class Gemv:
    """`x @ weight + bias` (then + residual, then the activation) for x [M, K] with M <=
    MAX_ROWS; `weight` is given [K, N] as the graph holds it and kept [N, K]. Calls report
    themselves to a native plan's recorder like a generated kernel."""

    def __init__(self, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 unary=None, residual: bool = False):
        k, n = weight.shape
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a few-row product takes 1 to {MAX_ROWS} rows, not {rows}")
        self.fn = kernel()
        if self.fn is None:
            raise build.BuildError("the few-row product kernel is unavailable")
        self.address = ctypes.cast(self.fn, ctypes.c_void_p).value
        self.weight = weight.detach().to(torch.float32).t().contiguous()
        self.bias = torch.zeros(n) if bias is None else \
            bias.detach().to(torch.float32).reshape(n).contiguous()
        self.shape = torch.tensor([rows, k, n, UNARY[unary], int(residual)], dtype=torch.int64)
        self.in_shape, self.out_shape = (rows, k), (rows, n)
        self.residual = residual

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if tuple(x.shape) != self.in_shape or x.dtype != torch.float32:
            raise ValueError(f"a few-row product built for {self.in_shape} float32 got "
                             f"{tuple(x.shape)} {x.dtype}")
        out = torch.empty(self.out_shape, dtype=torch.float32)
        tensors = [out, x.contiguous(), self.weight, self.bias, self.shape]
        if self.residual:
            tensors.append(residual.reshape(self.out_shape).contiguous())
        argv = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
        self.fn(argv)
        from .lower import CppKernel  # a native plan's recorder listens there
        if CppKernel.recording is not None:
            CppKernel.recording(self.address, tensors)
        return out
