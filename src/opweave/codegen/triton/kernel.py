"""Load generated Triton kernels and launch them.

Triton compiles a `@triton.jit` function from its source file, so each kernel is written
to `<cache>/triton/<name>.py`; the name carries the sha256 of the source, and a file is
imported only after its content hashes to its name (a truncated or edited file is
rewritten, never run). Launch configurations (rows and columns per program, warps) are
measured on the GPU at a kernel's first call among a few candidates and recorded in the
tuning database, keyed by the kernel and the GPU's name; on the CPU (Triton's
interpreter) the first candidate is taken.
"""
from __future__ import annotations

import hashlib
import os
import sys
import types

import torch

from ... import tune
from ...files import atomic_write, cache_root
from ...notices import OpweaveFallbackWarning, warn_once
from .render import TritonSource

KIND = "triton-launch"  # the tuning database's record kind


class KernelWarning(OpweaveFallbackWarning):
    """A generated Triton kernel failed; its group runs as torch ops."""
TILE = 2048             # elements per program a pointwise tile aims at


def available() -> bool:
    """Whether Triton is installed (an optional extra: `pip install opweave[triton]`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load(src: TritonSource):
    """The compiled-on-first-launch `@triton.jit` function of `src`. The module executed
    is the text checked against the source, and Triton (which compiles what it reads back
    from the file) must have read that same text."""
    module_name = f"opweave_triton_{src.name}"
    if module_name in sys.modules:
        return getattr(sys.modules[module_name], src.name)
    folder = cache_root() / "triton"
    path = folder / f"{src.name}_{_digest(src.body)[:16]}.py"
    if not path.exists() or _digest(path.read_text()) != _digest(src.body):
        atomic_write(path, lambda tmp: tmp.write_text(src.body))
    text = path.read_text()
    if _digest(text) != _digest(src.body):
        raise RuntimeError(f"the Triton kernel file {path} does not hold the source written "
                           "to it; refusing to import it")
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    exec(compile(text, str(path), "exec"), module.__dict__)  # noqa: S102 (checked above)
    fn = getattr(module, src.name)
    read = getattr(fn, "src", None)  # what Triton will compile (the interpreter has none)
    if read is not None and read.strip() not in src.body:
        raise RuntimeError(f"the Triton kernel file {path} changed while it was loaded")
    sys.modules[module_name] = module
    return fn


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidates(src: TritonSource) -> list[tuple[int, int, int]]:
    """(BR, BC, warps) to try, the heuristic first."""
    cols = src.cols
    if src.kind in ("row", "row_sum"):
        bc = _pow2(cols)
        br = max(1, min(_pow2(src.rows), TILE // bc))
        warps = 4 if bc * br <= 2048 else 8 if bc * br <= 8192 else 16
        alts = [(br, bc, warps), (max(1, br // 2), bc, warps), (br, bc, max(1, warps // 2)),
                (min(_pow2(src.rows), br * 2), bc, min(16, warps * 2))]
    elif src.kind == "column_sum":
        # the tile sets the order partial sums are added in: fixed, so that the bits do
        # not depend on which launch won the timing (only the warps are tuned)
        bc = min(_pow2(cols), 256)
        alts = [(32, bc, 4), (32, bc, 8)]
    else:
        bc = min(_pow2(cols), TILE if src.rows == 1 else 256)
        br = max(1, min(_pow2(src.rows), TILE // bc))
        alts = [(br, bc, 4), (br, bc, 8), (max(1, br // 2), bc, 4), (br, max(16, bc // 2), 4)]
    return list(dict.fromkeys(alts))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(src: TritonSource, br: int, bc: int, device) -> tuple[int, int, int]:
    """(programs, column-sum slices, row tiles per slice) of a launch."""
    ncb = _cdiv(src.cols, bc)
    if src.kind == "row" or src.kind == "row_sum":
        return _cdiv(src.rows, br), 1, 1
    if src.kind == "pointwise":
        return _cdiv(src.rows, br) * ncb, 1, 1
    # column sums: enough row slices to fill the GPU, each at least a few tiles long
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    slices = max(1, min(_cdiv(src.rows, 4 * br), _cdiv(4 * sms, ncb)))
    return ncb * slices, slices, _cdiv(_cdiv(src.rows, slices), br)


class TritonKernel:
    """Calls one generated kernel: allocates its outputs on the inputs' device, passes
    contiguous inputs, and adds a column sum's partial rows in order."""

    def __init__(self, src: TritonSource, fallback=None):
        self.source = src
        self.fn = load(src)
        self.fallback = fallback  # the group's nodes as torch ops, if the kernel fails
        self.failed: str | None = None
        self.out_types = [(v.type.shape, v.type.dtype) for v in src.outputs]
        self.config: tuple[int, ...] | None = None
        self._grids: dict[tuple, tuple[int, int, int]] = {}  # per (config, device)

    def launch(self, config, outs, ins):
        br, bc, warps = config
        device = ins[0].device if ins else outs[0].device
        grid = self._grids.get((config, device))
        if grid is None:
            grid = self._grids[config, device] = _grid(self.source, br, bc, device)
        programs, slices, trips = grid
        extra = []
        if self.source.reduced is not None:
            part = torch.empty((slices, self.source.cols), dtype=torch.float32, device=device)
            k = self.source.outputs.index(self.source.reduced)
            outs[k] = part  # the kernel writes the partial rows; their sum is the output
            extra = [part, slices, trips]
        self.fn[(programs,)](*outs, *ins, *extra, BR=br, BC=bc, num_warps=warps)
        if extra:
            outs[k] = torch.sum(part, 0).view(self.out_types[k][0])
        return outs

    def _arguments(self, inputs) -> list[torch.Tensor]:
        """The inputs as the kernel reads them: contiguous."""
        return [x if x.is_contiguous() else x.contiguous() for x in inputs]

    def _outputs(self, device) -> list[torch.Tensor]:
        reduced = self.source.reduced
        return [None if v is reduced else torch.empty(shape, dtype=dtype, device=device)
                for v, (shape, dtype) in zip(self.source.outputs, self.out_types)]

    def __call__(self, *inputs):
        if self.failed is not None:
            return self.fallback(*inputs)
        ins = self._arguments(inputs)
        outs = self._outputs(inputs[0].device if inputs else _default_device())
        if self.config is not None:
            return self.launch(self.config, outs, ins)
        try:  # the first call compiles the kernel (and measures its launches)
            self.config = self._choose(outs, ins)
            return self.launch(self.config, outs, ins)
        except Exception as err:  # noqa: BLE001  (a kernel that fails must not cost the model)
            if self.fallback is None:
                raise
            self.failed = f"{type(err).__name__}: {err}"
            warn_once(f"opweave: Triton kernel {self.source.name} failed to compile or run, so "
                      f"its ops run as torch ops: {self.failed}", KernelWarning)
            return self.fallback(*inputs)

    def candidates(self) -> list[tuple[int, ...]]:
        return candidates(self.source)

    def _choose(self, outs, ins) -> tuple[int, ...]:
        options = self.candidates()
        device = ins[0].device if ins else _default_device()
        if device.type != "cuda" or interpreting() or len(options) == 1:
            return options[0]
        key = (self.source.name, torch.cuda.get_device_name(device))
        names = {"x".join(map(str, c)): c for c in options}
        recalled = tune.recall(KIND, key, names)
        if recalled is not None:
            return names[recalled[0]]
        samples = {name: _cuda_times(lambda c=c: self.launch(c, list(outs), ins))
                   for name, c in names.items()}
        best = min(samples, key=lambda n: min(samples[n]))
        tune.remember(KIND, key, best, samples)
        return names[best]


def _default_device() -> torch.device:
    """Where a kernel that reads no tensor writes (its inputs were all literals)."""
    return torch.device("cpu" if interpreting() else "cuda")


def _cuda_times(run, rounds: int = 5) -> list[float]:
    """Seconds per launch, each round the mean of a few launches between CUDA events."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 3e3)
    return times


