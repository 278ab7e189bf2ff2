"""Code generation: fused groups become library calls (oneDNN with post-ops) and generated
C++ kernels. `lower(graph)` is the entry point; `opweave.pipeline` calls it last."""
from __future__ import annotations

from .lower import FusionWarning, Lowered, lower

__all__ = ["lower", "Lowered", "FusionWarning"]
