"""Triton code generation for GPU tensors (docs/gpu.md): the fused groups the partitioner
forms, rendered as Triton kernels (render.py), loaded and launched (kernel.py), and the
lowering that pairs them with torch's CUDA library calls (lower.py). Triton is optional:
without it, the groups run as torch ops."""
