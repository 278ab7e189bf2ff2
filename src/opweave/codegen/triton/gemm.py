"""A linear layer and its epilogue as one Triton kernel, chosen against cuBLAS plus a
separate epilogue kernel by measurement.

The template is Triton's blocked matmul (program ids grouped along M so neighbouring
programs share the weight's columns in L2), accumulating in float32, with the anchor
group's epilogue (bias, activation, residual add; reshapes that keep the last axis are
free) applied to the accumulator before the one store: the product never goes to memory
unfinished. `tl.dot` computes in TF32 when torch allows TF32 for matmuls (as cuBLAS
does), else in IEEE float32.

`GemmChoice` runs the template or the split form (cuBLAS through torch, then the
epilogue's Triton kernel) as measured at its first call on the GPU, and records the
choice in the tuning database (kind "triton-gemm", keyed by the template and the GPU).
On the CPU, under Triton's interpreter, the split form runs unless a test asks for the
template.
"""
from __future__ import annotations

import hashlib

import torch

from ... import tune
from ...ir.graph import Node, Value
from ...notices import warn_once
from ..render import formula
from .kernel import KernelWarning, TritonKernel, _cdiv, _cuda_times, interpreting
from .render import _HEADER, TRITON, TritonSource

KIND = "triton-gemm"
CONFIGS = [(64, 64, 32, 4), (128, 64, 32, 4), (64, 128, 32, 4), (128, 128, 32, 8), (32, 64, 32, 4)]


def render_gemm(anchor: Node, chain: list[Node], tf32: bool) -> TritonSource | None:
    """The template for `matmul(x, w)` followed by `chain`, or None where it does not
    apply: other dtypes, a weight that is not a 2-D constant (or its transposed view), an
    epilogue that changes the last axis or reads an operand of another shape."""
    x, w = anchor.inputs
    if not all(v.type.dtype == torch.float32 for v in (x, w, anchor.outputs[0])):
        return None
    strides = _weight_strides(w)
    if x.type.rank < 2 or strides is None:
        return None
    k, n = w.type.shape
    m = x.type.numel // k
    names = {anchor.outputs[0]: "acc"}
    inputs: list[Value] = [x, w]
    lines = []
    for i, node in enumerate(chain):
        out = node.outputs[0]
        if out.type.shape[-1] != n or out.type.numel != m * n:
            return None
        if node.op == "reshape":
            names[out] = names[node.inputs[0]]
            continue
        args = []
        for v in node.inputs:
            if v in names:
                args.append(names[v])
                continue
            operand = _operand(v, m, n, 1 + len(inputs))
            if operand is None:
                return None
            inputs.append(v)
            args.append(operand)
        try:
            lines.append(f"t{i} = {formula(node, args, TRITON)}")
        except NotImplementedError:
            return None
        names[out] = f"t{i}"
    last = chain[-1].outputs[0] if chain else anchor.outputs[0]
    precision = "tf32" if tf32 else "ieee"
    sk, sn = strides
    body = [
        f"M = {m}", f"N = {n}", f"K = {k}",
        "pid = tl.program_id(0).to(tl.int64)",
        "NM = (M + BM - 1) // BM", "NN = (N + BN - 1) // BN",
        "width = GROUP * NN", "first = pid // width * GROUP",
        "size = tl.minimum(NM - first, GROUP)",
        "pm = first + (pid % width) % size", "pn = (pid % width) // size",
        "rm = pm * BM + tl.arange(0, BM)",
        "rn = pn * BN + tl.arange(0, BN)",
        "rk = tl.arange(0, BK).to(tl.int64)",
        "acc = tl.zeros((BM, BN), dtype=tl.float32)",
        f"for k0 in range(0, {k}, BK):",  # a literal bound: the interpreter needs one
        "    kk = k0 + rk",
        "    a = tl.load(a1 + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)",
        f"    b = tl.load(a2 + kk[:, None] * {sk} + rn[None, :] * {sn}, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)",
        f'    acc = tl.dot(a, b, acc, input_precision="{precision}")',
        "r = rm[:, None]", "j = rn[None, :]",
        "zero = tl.zeros((BM, BN), tl.int64)",
        "m = (r < M) & (j < N)",
        *lines,
        f"tl.store(a0 + r * N + j, {names[last]}, mask=m)",
    ]
    args = ", ".join([f"a{i}" for i in range(1 + len(inputs))]
                     + ["BM: tl.constexpr", "BN: tl.constexpr", "BK: tl.constexpr", "GROUP: tl.constexpr"])
    text = "\n".join(body)
    name = "ow_g_" + hashlib.sha256(f"{args}\n{text}".encode()).hexdigest()[:16]
    source = f"{_HEADER}@triton.jit\ndef {name}({args}):\n" + "\n".join("    " + ln for ln in body) + "\n"
    return TritonSource(name, source, inputs, [last], "gemm", m, n)


def tf32_allowed() -> bool:
    """Whether torch lets float32 matmuls use TF32: the legacy flag, or the per-backend
    precision newer code sets (reading the legacy flag after that raises)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except (RuntimeError, AttributeError):
        return getattr(matmul, "fp32_precision", "ieee") == "tf32"


def _weight_strides(w: Value) -> tuple[int, int] | None:
    """(stride of k, stride of n) of a [K, N] constant weight, or of the transposed view
    of an [N, K] one (how the gemm-layout pass stores linear weights)."""
    if w.type.rank != 2:
        return None
    k, n = w.type.shape
    p = w.producer
    if p is None:
        return None
    if p.op == "constant":
        return n, 1
    if p.op == "permute" and p.attrs["dims"] == [1, 0] and p.inputs[0].producer is not None \
            and p.inputs[0].producer.op == "constant":
        return 1, k
    return None


def _operand(v: Value, m: int, n: int, position: int) -> str | None:
    """How the epilogue reads operand `v` (argument number `position`): a row vector such
    as a bias (by column), or a tensor of the product's size such as a residual (by
    element). (The partition's epilogues hold no other operands: they are the CPU
    library's post-ops.)"""
    shape = v.type.shape
    if v.type.dtype != torch.float32 or not shape or shape[-1] != n:
        return None
    if v.type.numel == n:
        return f"tl.load(a{position} + j + zero, mask=m, other=0)"
    if v.type.numel == m * n:
        return f"tl.load(a{position} + r * N + j, mask=m, other=0)"
    return None


class GemmTemplateKernel(TritonKernel):
    """Launches the template: a program per (BM x BN) tile of the product."""

    def __init__(self, src: TritonSource, tf32: bool):
        super().__init__(src)
        self.strides = _weight_strides(src.inputs[1])  # baked into the kernel
        self.tf32 = tf32  # what its tl.dot computes in

    def candidates(self) -> list[tuple[int, ...]]:
        return CONFIGS

    def fits(self, inputs) -> bool:
        """The weight has the strides the kernel was written for, and torch's TF32 setting
        is still the one it was written for (cuBLAS follows it at each call)."""
        return tuple(inputs[1].stride()) == self.strides and tf32_allowed() == self.tf32

    def _arguments(self, inputs) -> list[torch.Tensor]:
        """Contiguous, but the weight: its view is read through the baked strides."""
        return [x if i == 1 or x.is_contiguous() else x.contiguous() for i, x in enumerate(inputs)]

    def launch(self, config, outs, ins):
        bm, bn, bk, warps = config
        programs = _cdiv(self.source.rows, bm) * _cdiv(self.source.cols, bn)
        self.fn[(programs,)](*outs, *ins, BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps)
        return outs


class GemmChoice:
    """A linear layer with its epilogue: the template or the split form, by measurement."""

    def __init__(self, split, template: GemmTemplateKernel, force: str | None = None):
        self.split = split          # both take the group's inputs: x, w, the operands
        self.template = template
        self.chosen: str | None = force

    def __call__(self, *inputs):
        if self.chosen is None:
            self.chosen = self._choose(inputs)
        if self.chosen == "template" and self.template.fits(inputs):
            return self.template(*inputs)
        return self.split(*inputs)

    def _choose(self, inputs) -> str:
        x = inputs[0]
        if not x.is_cuda or interpreting() or not self.template.fits(inputs):
            return "split"
        key = (self.template.source.name, torch.cuda.get_device_name(x.device))
        forms = {"split": self.split, "template": self.template}
        recalled = tune.recall(KIND, key, forms)
        if recalled is not None:
            return recalled[0]
        try:
            samples = {name: _cuda_times(lambda f=f: f(*inputs)) for name, f in forms.items()}
        except Exception as err:  # noqa: BLE001  (the template failed: cuBLAS it is)
            warn_once(f"opweave: the Triton GEMM template {self.template.source.name} failed, "
                      f"so cuBLAS and the epilogue kernel run: {type(err).__name__}: {err}",
                      KernelWarning)
            return "split"
        best = min(samples, key=lambda name: min(samples[name]))
        tune.remember(KIND, key, best, samples)
        return best
