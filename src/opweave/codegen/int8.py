"""Static int8 quantization of library groups (`precision="int8"`; docs/precision.md).

The policy. Linear layers and convolutions with constant weights (the library groups)
compute in int8 through oneDNN's `qlinear_pointwise` / `qconv2d_pointwise`, with weights
in int8 per output channel and activations in uint8 per tensor, from the ranges each
group's input reached in calibration (the arithmetic and the quantizer kernels:
codegen/quantize.py). The int32 accumulator is dequantized inside the primitive, with
the bias, the activation and a residual add as post-ops; the result is float32, or,
where every reader is itself an int8 group, uint8 codes at the readers' scale (fused
requantization: they then quantize nothing). A convolution summing into its residual
keeps the residual's type, so it runs on uint8 codes exactly where its result is one.
Everything else (norms, softmax, attention, pointwise kernels, products of two run-time
operands) stays float32, and graph inputs and outputs are float32.

Calibration. A group chosen int8 computes its float32 form while it calibrates, keeping
its input's range; then the scales are fixed, which results travel as codes is decided
(`decide_uint8`), and the groups switch to int8. The pipeline attaches a `Calibration` to
each executor with such groups. Calls made inside `calibrating()` calibrate (what
`opweave.compile(..., calibration=[...])` does with the batches given, or with the
example inputs), and a graph called before any calibration (a plan built for new sizes,
a torch.compile graph) calibrates on its first call. The measured choice between the
int8 and the float32 form is made at compile time with provisional scales (the time does
not depend on them), as every library choice is. The int8 form is measured as it will
run: on uint8 codes where its input (or residual) is made by another product that may
write them (`arrives_as_codes`), else on float32 it quantizes itself.
"""
from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch

from .. import shared_constants
from ..partition.classify import constant_of
from .precision import cpu_flags
from .quantize import MaxPoolCodes, Quantizer, activation_qmax, activation_qparams

QUANTIZED_OPS = frozenset({"matmul", "conv"})
# the ops each int8 precision quantizes: "int8-dynamic" only linear layers (as torch's
# dynamic quantization), their activations' ranges measured on every call
_OPS_OF = {"int8": QUANTIZED_OPS, "int8-dynamic": frozenset({"matmul"})}
# unary epilogues oneDNN fuses into an int8 product, per anchor op
FUSED_UNARY = {"matmul": frozenset({"relu", "gelu", "tanh", "clamp"}),
               "conv": frozenset({"relu", "clamp"})}
_PROVISIONAL = (8.0 / 255, 128)  # scale and zero point while measuring, before calibration
# ops a product's fused epilogue may end in (what the next group reads is their result)
_EPILOGUE_OPS = frozenset({"relu", "gelu", "tanh", "clamp", "add"})


def arrives_as_codes(graph, v) -> bool:
    """Whether an int8 group's operand `v` may arrive as uint8 codes: it is made, through
    views, by a linear layer or convolution with a constant weight, or by the epilogue of
    one (bias, activation; a residual add of a convolution's), which then writes codes
    wherever all its readers are int8 groups (`decide_uint8`); or it is rows gathered
    from a constant table (`CodeGather`). Structural, so the choice it informs is the same
    whatever was chosen for the producer: ResNet's and XML-CNN's convolutions read codes
    (ResNet's first ones through its max pooling), BERT's products after a layer norm and
    GCN's on its input features read float32."""
    return _made_by_product(graph, v, depth=3)


def passes_codes(node) -> bool:
    """Whether `node` hands on uint8 codes as they come: a view, or a max pooling (max
    commutes with quantizing, which is monotonic: `CodesMaxPool`)."""
    if node.opdef.is_view:
        return bool(node.inputs)
    a = node.attrs
    return (node.op == "max_pool2d" and not a.get("with_indices") and not a.get("ceil_mode")
            and len(node.inputs[0].type.shape) == 4)


def _made_by_product(graph, v, depth: int, products=QUANTIZED_OPS) -> bool:
    p = v.producer
    while p is not None and passes_codes(p):
        p = p.inputs[0].producer
    if p is None:  # a graph input
        return False
    if p.op in QUANTIZED_OPS:
        return (p.op in products and len(p.inputs) > 1
                and constant_of(graph, p.inputs[1]) is not None)
    if _table_of(graph, p) is not None:
        return True
    if depth == 0 or p.op not in _EPILOGUE_OPS:
        return False
    if p.op == "add" and all(constant_of(graph, u) is None for u in p.inputs):
        products = frozenset({"conv"})  # a residual add: a linear layer's writes float32
    return any(_made_by_product(graph, u, depth - 1, products) for u in p.inputs)


def _codes_like(x: torch.Tensor) -> torch.Tensor:
    """Random uint8 codes in `x`'s shape and layout: an operand as a producer writing codes
    hands it over."""
    codes = torch.empty_like(x, dtype=torch.uint8)
    return codes.random_(0, 256)


def applies(precision: str, op: str) -> bool:
    """Whether a library group anchored on `op` may compute in int8 under `precision`."""
    return op in quantized_ops(precision)


def quantized_ops(precision: str) -> frozenset[str]:
    return _OPS_OF.get(precision, frozenset())


def units(cpuinfo: str | None = None) -> str:
    """The CPU's int8 units, as `explain` and the bench report them."""
    flags = cpu_flags(cpuinfo)
    if "amx_int8" in flags:
        return "AMX int8 tiles"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "VNNI int8 dot products (no AMX)"
    return "no int8 dot-product units: 7-bit activations, slower than VNNI"


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
    run while it calibrates. States: "measuring" (provisional scales, for timing; built at
    its first call), "calibrating" (float32, keeping the ranges of its input and residual),
    "ready" (int8, or float32 where calibration failed)."""

    def __init__(self, build: Callable, fp32: Callable, requantizes: bool, sums: bool = False,
                 codes_in: bool = False, codes_accum: bool = False):
        self.build, self.fp32 = build, fp32
        self.requantizes = requantizes  # whether `build` may write uint8
        self.sums = sums                # a convolution summing into its residual
        # measured on codes for its input / residual (`arrives_as_codes`; `measured_args`)
        self.codes_in, self.codes_accum = codes_in, codes_accum and sums
        self.state = "measuring"
        self.input_range, self.accum_range = Range(), Range()
        self.qparams: tuple[float, int] | None = None        # its input's
        self.accum_qparams: tuple[float, int] | None = None  # its residual's (`sums`)
        self.requantize: tuple[float, int] | None = None     # its readers' input qparams
        self.accum_in_uint8 = False
        self.in_int8 = False  # ready and computing in int8 (not its float32 fallback)
        # set by `link_requantization`: the int8 groups reading its result and how
        # ("input" or "accum"), None where another step reads it; the group making its
        # residual, if one does
        self.readers: list[tuple[Int8Group, str]] | None = None
        self.accum_from: Int8Group | None = None
        self._run: Callable | None = None
        self._measuring: dict[bool, Callable] = {}  # by whether the residual is codes

    def start_calibration(self) -> None:
        self.state = "calibrating"
        self._run = None
        self._measuring.clear()

    def fix_scales(self) -> None:
        self.qparams = self.input_range.qparams()
        if self.sums:
            self.accum_qparams = self.accum_range.qparams()

    def readers_qparams(self) -> tuple[float, int] | None:
        """The one scale and zero point its readers take its result at, if they agree."""
        found = {r.qparams if role == "input" else r.accum_qparams
                 for r, role in self.readers or ()}
        return found.pop() if len(found) == 1 else None

    def built(self, requantize: tuple[float, int] | None, accum_in_uint8: bool) -> Callable:
        """Its int8 function, writing uint8 at `requantize` if given."""
        return self.build(*self.qparams, requantize,
                          self.accum_qparams if accum_in_uint8 else None)

    def switch(self, run: Callable, requantize=None, accum_in_uint8: bool = False,
               in_int8: bool = True) -> None:
        """Run `run` from now on: its int8 function, or its float32 form."""
        self.requantize, self.accum_in_uint8, self.in_int8 = requantize, accum_in_uint8, in_int8
        self._run, self.fp32, self.build = run, None, None
        self.state = "ready"

    def measured_args(self, args: list) -> list:
        """The arguments it is measured on (choice.measure): float32 example operands,
        as uint8 codes where they may arrive so (the quantizer's time is then not its)."""
        args = list(args)
        if self.codes_in:
            args[0] = _codes_like(args[0])
        if self.codes_accum:
            args[1] = _codes_like(args[1])
        return args

    def __call__(self, x, *rest):
        if self.state == "calibrating":
            self.input_range.observe(x)
            if self.sums:
                self.accum_range.observe(rest[0])
            return self.fp32(x, *rest)
        if self._run is not None:
            return self._run(x, *rest)
        # measuring: built at its first call; a residual of codes makes a result of codes
        accum_codes = self.sums and rest[0].dtype == torch.uint8
        run = self._measuring.get(accum_codes)
        if run is None:
            codes = _PROVISIONAL if accum_codes else None
            run = self._measuring[accum_codes] = self.build(*_PROVISIONAL, codes, codes)
        return run(x, *rest)


def decide_uint8(groups: list[Int8Group]) -> set[Int8Group]:
    """The groups that write uint8 codes (after every group fixed its scales): those whose
    every reader is an int8 group taking the result at one scale, where, for a convolution
    summing into its residual, the residual arrives in uint8 too, since its result keeps
    the residual's type (and the other way round: a residual in uint8 only for a group
    that then writes uint8). ResNet's last stage stays float32, its output going to the
    average pooling; the stages before it run uint8 end to end. None with 7-bit
    activations (no int8 units): oneDNN's requantized codes would use all 8 bits."""
    if activation_qmax() != 255:
        return set()
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

    def __init__(self, groups: list[Int8Group], gathers: list[CodeGather] = ()):
        self.groups, self.gathers = groups, list(gathers)
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
        """Fix the scales, decide which results travel as codes and build every int8
        function, then switch all the groups at once. If any of that fails (a non-finite
        range, a primitive refusing its scales), every group keeps its float32 form, with
        one warning: a half-switched graph would hand codes to groups expecting floats."""
        if self.done:
            return
        try:
            for g in self.groups:
                g.fix_scales()
            writes = decide_uint8(self.groups)
            plans = [(g.readers_qparams() if g in writes else None,
                      g.sums and g.accum_from in writes) for g in self.groups]
            runs = [g.built(*plan) for g, plan in zip(self.groups, plans)]
        except Exception as err:  # noqa: BLE001  (the graph still runs, in float32)
            warnings.warn(f"opweave: int8 calibration failed ({type(err).__name__}: {err}); "
                          f"the {len(self.groups)} int8 groups of this graph compute in "
                          "float32", Int8Warning, stacklevel=4)
            for g in self.groups:
                g.switch(g.fp32, in_int8=False)
        else:
            for g, run, plan in zip(self.groups, runs, plans):
                g.switch(run, *plan)
            for gather in self.gathers:
                gather.finish()
        self.done = True


class Int8Warning(UserWarning):
    """int8 could not be applied where it was asked for; the graph computes in float32."""


_session: ContextVar[dict | None] = ContextVar("opweave_int8_calibration", default=None)


@contextmanager
def calibrating():
    """Calls made meanwhile (in this thread) calibrate the int8 groups they reach, also
    those of plans built during them; leaving without an error fixes their scales, and
    they compute in int8 from then on. Yields the calibrations reached (by id): empty
    when the calls reached no int8 group still to calibrate."""
    session: dict = {}
    token = _session.set(session)
    try:
        yield session
    finally:
        _session.reset(token)
    for calibration in session.values():
        calibration.finish()


def link_requantization(graph, steps) -> list[CodeGather]:
    """Record which int8 groups read each int8 group's result, and how: as their input
    (first operand) or as the residual a convolution sums into (second), directly or
    through single view ops and max poolings (which then pool codes: `CodesMaxPool`); a
    result any other step reads, or a graph output, keeps
    `readers` None and stays float32. Also each summing group's residual maker.
    `decide_uint8` picks, once scales are known, which results travel as uint8 codes.
    A gather of rows from a constant table that only int8 groups read as their input
    becomes a `CodeGather` (returned, for the executor's `Calibration`)."""
    readers: dict = {}
    made_by: dict = {}
    for step in steps:
        for i, v in enumerate(step.inputs):
            readers.setdefault(v, []).append((step, i))
        for v in step.outputs:
            made_by[v] = step
    outputs = set(graph.outputs)

    def passes(step) -> bool:  # a view op, or a max pooling (a torch op or a template kernel)
        return step.kind in ("op", "cpp") and len(step.nodes) == 1 and passes_codes(step.nodes[0])

    def int8_uses(v, found) -> bool:
        uses = readers.get(v)
        if not uses or v in outputs:
            return False
        for r, i in uses:
            if isinstance(r.fn, Int8Group) and (i == 0 or (i == 1 and r.fn.sums)):
                found.append((r.fn, "input" if i == 0 else "accum"))
            elif not (passes(r) and all(int8_uses(o, found) for o in r.outputs)):
                return False
        return True

    def maker(v):
        step = made_by.get(v)
        while step is not None and passes(step):
            step = made_by.get(step.inputs[0])
        return step.fn if step is not None and isinstance(step.fn, Int8Group) else None

    gathers = []
    for step in steps:
        if passes(step) and not step.nodes[0].opdef.is_view:
            step.fn = CodesMaxPool(step.fn, step.nodes[0])
            continue
        group = step.fn
        if isinstance(group, Int8Group):
            if group.sums:
                group.accum_from = maker(step.inputs[1])
            found: list = []
            if len(step.outputs) == 1 and int8_uses(step.outputs[0], found):
                group.readers = found
            continue
        table = _gathered_table(graph, step)
        found = []
        if table is not None and int8_uses(step.outputs[0], found) \
                and all(role == "input" for _, role in found):
            step.fn = CodeGather(step.fn, table, [r for r, _ in found])
            gathers.append(step.fn)
    return gathers


def _gathered_table(graph, step) -> torch.Tensor | None:
    """The constant float32 table a step gathers whole rows of (`index_select` on dim 0:
    an embedding), or None."""
    if step.kind != "op" or len(step.nodes) != 1:
        return None
    return _table_of(graph, step.nodes[0])


def _table_of(graph, node) -> torch.Tensor | None:
    """The constant float32 table `node` gathers whole rows of, or None."""
    if node.op != "index_select" or node.attrs.get("dim") != 0:
        return None
    producer = node.inputs[0].producer
    if producer is None or producer.op != "constant":
        return None
    table = graph.constants[producer.attrs["name"]]
    return table if table.dtype == torch.float32 and table.dim() == 2 else None


class CodesMaxPool:
    """A max pooling step in an int8 graph: it pools uint8 codes where its producer writes
    them (the codes of the pooled values, at the same scale), float32 otherwise."""

    def __init__(self, fn: Callable, node):
        a = node.attrs
        self.fn = fn
        self.codes = MaxPoolCodes(a["kernel"], a["stride"], a["padding"], a["dilation"])

    def __call__(self, x):
        return [self.codes(x)] if x.dtype == torch.uint8 else self.fn(x)


class CodeGather:
    """An embedding (rows gathered from a constant table) read only by int8 groups as
    their input. Once their scale is fixed, the table is quantized once at it, and the
    step gathers codes: the very codes quantizing the gathered rows would give (both are
    elementwise), a quarter of the bytes, and the readers quantize nothing."""

    def __init__(self, fn: Callable, table: torch.Tensor, readers: list[Int8Group]):
        self.fn, self.table, self.readers = fn, table, readers
        self.codes: torch.Tensor | None = None

    def finish(self) -> None:
        """Gather codes if every reader computes in int8 at one scale (else float32 rows,
        which the readers quantize themselves: the same result)."""
        found = {r.qparams for r in self.readers}
        if len(found) == 1 and all(r.in_int8 for r in self.readers):
            qparams = found.pop()
            # one codes table for the plans of a sharing scope (one per size) at one scale
            self.codes = shared_constants.derived(
                "int8-codes", [self.table], qparams,
                lambda: Quantizer(*qparams)(self.table.contiguous()))

    def __call__(self, table, index):
        if self.codes is None:
            return self.fn(table, index)
        return [torch.index_select(self.codes, 0, index)]
