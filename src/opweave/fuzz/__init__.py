"""`opweave fuzz`: a differential fuzzer of the whole pipeline.

Random valid graphs are built from the op registry's own shape and dtype rules
(`generate`), given inputs on which eager PyTorch runs cleanly (`oracle`), and run
through every path (`check`): `opweave.compile`, `torch.compile(backend="opweave")`, the
ONNX round trip (`opweave.to_onnx`, then `opweave.from_onnx`) and, where the graph has a
gradient, the training step (`opweave.compile(train=True)`), each compared with eager.
Before those, a `rules` check runs each node's reference implementation and compares the
types it computes with the ones the rules declare. A failure is minimised (`minimize`)
and written as a standalone script (`reproducer`).

Ops not generated, and why (`generate.EXCLUDED`):
  dropout                       random; no eager oracle draws the same mask
  sparse_mm                     needs coalesced COO operands, which opweave takes only as
                                constants (the GCN models test it)
  scatter                       random indices repeat, and then which write wins is
                                unspecified
  max_pool2d_backward,          their indices must come from the forward pool; the train
  adaptive_max_pool2d_backward  path reaches them from the pools
  constant                      constants enter as operands, not as drawn ops
and `index_put` is generated with accumulate=True only (same reason as scatter).
`conv_backward` is registered but rarely generated: its rule leaves the gradient's shape
to the kernel; the train path reaches it from conv.

Tolerances (one place: `check.TOLERANCES` and `check.NOISE`): integers and bools exactly;
float32 within 1e-4 absolute plus 1e-4 relative, float64 within 1e-9 of each, each plus
8x the largest distance between eager and a float64 run of the same graph in that
tensor (reductions and GEMMs reassociate; ill-conditioned points are allowed the error
eager itself has there).

Fallbacks are judged too: a pass that crashed and was skipped (rewrite, fusion), a
lowering that raised, or a capture that fell back fails the path; an op opweave
deliberately leaves to eager (no lowering, or a use it declines) is a coverage gap, not a
failure. Paths that do not apply (no ONNX form, no gradient) are counted apart.

`blocks` (`opweave fuzz --blocks N --precision P`) fuzzes the precision modes instead:
random networks of the benchmark models' blocks, compiled in one precision and checked
against float64 within that precision's tolerance.
"""
from .runner import FuzzConfig, Summary, fuzz

__all__ = ["FuzzConfig", "Summary", "fuzz"]
