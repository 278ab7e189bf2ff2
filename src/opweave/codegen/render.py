"""Render one fused group of one-to-one ops (and at most one reduction) as C++.
A row reduction is softmax, log-softmax, layer norm, or a sum or mean along the last axis;
a column sum (over every axis but the last) is the other kind.

The kernel walks the group's iteration space as rows (all axes but the last) by columns
(the last axis). Rows are split across OpenMP threads; the column loop carries
`#pragma omp simd` and only branch-free arithmetic, so g++ vectorizes it (tests check the
compiler's vectorization report). Every input is read in place through its broadcast
strides, baked in as constants: a bias indexes by column, a per-channel scale by a row
formula. A row reduction computes its input row into a buffer, reduces it, then runs the
epilogue; prologue values the epilogue needs are recomputed rather than stored. A column
sum accumulates each thread's rows into its own partial sums, added up in thread order
afterwards (deterministic for a given thread count and schedule: a recorded schedule,
codegen/kernel_schedule.py, may run it on one thread).
Signature: `void name(void** args)`, args = outputs then inputs, all contiguous.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ..ir import Graph
from ..ir.graph import Node, Value
from ..partition.classify import Fusible, is_column_sum, iteration_shape

PARALLEL_MIN = 32768  # elements below which a kernel runs on one thread
CHANNELS_LAST = (0, 2, 3, 1)  # N, C, H, W walked as N, H, W, C


@dataclass
class KernelSource:
    name: str
    body: str                 # C++ function definition (name filled in)
    inputs: list[Value]       # in argument order, after the outputs
    outputs: list[Value]
    # every input has the output's shape and no row reduction: the kernel only pairs up
    # elements, so it runs on any layout the inputs share (channels-last, say)
    layout_free: bool = False
    # the line of `body` (1-based) where each member node's value is computed, 0 where
    # it has no line of its own (a reduction's accumulator): the profiler's lowest level
    node_lines: dict = field(default_factory=dict)
    # a kernel that only pays on dense row-major inputs: other layouts run its nodes as
    # torch ops instead of copying (what CppKernel does for the others)
    contiguous_only: bool = False
    # a second function in `body`, for a channels-last 4-D input, writing the same output
    # (row-major), or a channels-last one where `channels_last_out`
    channels_last_name: str | None = None
    channels_last_out: bool = False
    # the inputs (positions) that must be channels-last for it, the others row-major;
    # None: all of them (a template's one input)
    dense_inputs: tuple[int, ...] | None = None
    # a template's same kernel on bfloat16 tensors (row-major, channels-last): it only
    # picks elements (max pooling), so a bf16 input gives the float32 result rounded
    bf16_names: tuple[str, str | None] | None = None
    # the input and output positions its functions read and write in bfloat16 (float32
    # math inside): a bf16 step's result read as it comes, widened in registers, and
    # results only bf16 steps read written rounded (codegen/precision.hand_off_in_bf16);
    # none in the form `render` makes first, these in a form made for them (`low=`)
    low_inputs: frozenset[int] = frozenset()
    low_outputs: frozenset[int] = frozenset()
    # the outputs after the group's own that repeat one of them in bfloat16 (`render`'s
    # `twins`): the positions of the outputs they repeat
    twins: tuple[int, ...] = ()
    # the schedule it was rendered under (None: the default), for its bf16 forms
    schedule: object = None

    def function_names(self) -> list[str]:
        """Every function `body` defines: the kernel and its variants."""
        return [n for n in (self.name, self.channels_last_name, *(self.bf16_names or ()))
                if n is not None]


class GroupEmitter:
    """What a fused group reads and writes and how each input is indexed from a row `r`
    and a column `j` of its iteration space; subclasses spell loads and formulas in their
    language (this one C++, codegen/triton the other)."""

    int_div = "/"  # integer division of non-negative row numbers
    # the inputs read in bfloat16 and the outputs written in it (`render(..., low=)`);
    # float32 math
    low_inputs: frozenset = frozenset()
    low_outputs: frozenset = frozenset()

    def __init__(self, graph: Graph, members: list[Node], escapes, channels_last=False):
        self.graph = graph
        self.members = members
        self.inside = set(members)
        # legality: one space for all members; walked as N, H, W, C for `channels_last`
        self.perm = CHANNELS_LAST if channels_last else None
        self.shape = self.shape_of(iteration_shape(members[0]))
        self.cols = self.shape[-1] if self.shape else 1
        self.rows = math.prod(self.shape[:-1]) if self.shape else 1
        self.inputs: list[Value] = []
        self.literals: dict[Value, str] = {}
        self.outputs = [v for n in members for v in n.outputs[:1] if escapes(v)]
        self.twins: dict[Value, list[Value]] = {}  # an output -> its values in bf16 too
        for n in members:
            for v in n.inputs:
                if v.producer in self.inside or v in self.inputs or v in self.literals:
                    continue
                literal = _literal(graph, v)
                if literal is not None:
                    self.literals[v] = literal
                else:
                    self.inputs.append(v)
        self.names = {v: f"t{i}" for i, v in enumerate(v for n in members for v in n.outputs[:1])}
        self.elementwise = not channels_last and all(
            v.type.shape == self.shape for v in self.inputs) and not any(
            n.op in ROW_REDUCE_OPS | ROW_SUM_OPS for n in members)
        if self.elementwise:
            # Nothing is broadcast: one flat loop, split across threads and vectorized
            # as a whole (NCHW rows of 7 or 56 elements vectorize poorly).
            self.rows, self.cols = 1, math.prod(self.shape)

    def in_bf16(self, low_in, low_out, twins) -> None:
        """Read the inputs and write the outputs at positions `low_in` and `low_out` in
        bfloat16, and also write each output at a position in `twins` rounded into the
        value paired with it (appended to the outputs): `render`'s `low` and `twins`."""
        self.low_inputs = frozenset(self.inputs[i] for i in low_in)
        self.low_outputs = frozenset(self.outputs[i] for i in low_out) | {v for _, v in twins}
        for position, value in twins:
            self.twins.setdefault(self.outputs[position], []).append(value)
        self.outputs = self.outputs + [value for _, value in twins]

    def shape_of(self, v: Value | tuple) -> tuple:
        """A value's shape (or a shape) in the order the kernel walks it: as declared, or
        padded to 4-D and permuted to N, H, W, C."""
        shape = tuple(v.type.shape) if isinstance(v, Value) else tuple(v)
        if self.perm is None:
            return shape
        shape = (1,) * (4 - len(shape)) + shape
        return tuple(shape[p] for p in self.perm)

    def arg(self, v: Value) -> str:
        return f"a{len(self.outputs) + self.inputs.index(v)}"

    def load(self, v: Value) -> str:
        if v in self.literals:
            return self.literals[v]
        if v in self.names:
            return self.names[v]
        return self.element(v)

    def element(self, v: Value) -> str:
        """Input `v`'s element at the current row and column."""
        if v in self.low_inputs:
            return f"ow_bf16_widen({self.arg(v)}[{self.index(v)}])"
        return f"{self.arg(v)}[{self.index(v)}]"

    def index(self, v: Value) -> str:
        if self.elementwise:  # every input has the full shape: flat indexing
            return "j"
        shape = self.shape_of(v)
        full = self.shape
        pad = (1,) * (len(full) - len(shape)) + tuple(shape)
        strides, s = [], 1
        for d in reversed(pad):
            strides.append(0 if d == 1 else s)
            s *= d
        strides.reverse()
        inner = strides[-1] if full and full[-1] > 1 else 0
        terms = []
        lead = full[:-1]
        if tuple(pad) == tuple(full):
            terms.append(f"r * {self.cols}")
        else:
            for d, size in enumerate(lead):
                if strides[d] == 0 or size == 1:
                    continue
                div = math.prod(lead[d + 1:])
                row = "r" if div == 1 else f"(r {self.int_div} {div})"
                terms.append(f"({row} % {size}) * {strides[d]}")
        if inner:
            terms.append("j")
        return " + ".join(terms) or "0"

    def declare(self, node: Node) -> str:
        """`const T tN = <formula>;` for the node's value (bool for comparisons)."""
        ctype = "bool" if node.outputs[0].type.dtype == torch.bool else "float"
        return f"const {ctype} {self.names[node.outputs[0]]} = {self.expr(node)};"

    def expr(self, node: Node) -> str:
        ins = [self.load(v) for v in node.inputs]
        return formula(node, ins, CPP)


def _literal(graph: Graph, v: Value) -> str | None:
    p = v.producer
    if p is None or p.op != "constant" or v.type.numel != 1:
        return None
    x = float(graph.constants[p.attrs["name"]].reshape(()).item())
    if math.isnan(x):
        return "NAN"
    if math.isinf(x):
        return "INFINITY" if x > 0 else "(-INFINITY)"
    return f"{x!r}f" if "e" in repr(x) or "." in repr(x) else f"{x!r}.0f"


_ARITHMETIC = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_UNARY = {
    "neg": "(-{0})", "abs": "std::fabs({0})", "exp": "ow_exp({0})", "sqrt": "std::sqrt({0})",
    "rsqrt": "(1.0f / std::sqrt({0}))", "reciprocal": "(1.0f / {0})",
    "sigmoid": "ow_sigmoid({0})", "tanh": "ow_tanh({0})", "erf": "ow_erf({0})",
    "relu": "({0} < 0.0f ? 0.0f : {0})",
    "sign": "(float)(({0} > 0.0f) - ({0} < 0.0f))",  # NaN -> 0, as torch.sign
    "ceil": "std::ceil({0})", "floor": "std::floor({0})",
    "maximum": "(({0} > {1} || {0} != {0}) ? {0} : {1})",
    "minimum": "(({0} < {1} || {0} != {0}) ? {0} : {1})",
    "where": "({0} ? {1} : {2})", "pow": "ow_pow({0}, {1})",
}
ROW_REDUCE_OPS = frozenset({"softmax", "log_softmax", "layer_norm"})
# Plain reductions along the last axis (keeping it, as size 1): the decomposed backward
# of softmax, log-softmax and layer norm is made of them.
ROW_SUM_OPS = frozenset({"sum", "mean"})
# What this generator can emit; the partitioner forms groups from exactly this.
FUSIBLE = Fusible(
    pointwise=frozenset(_ARITHMETIC) | frozenset(_UNARY) | {"gelu", "clamp"},
    compare=frozenset(_COMPARE),
    row_reduce=ROW_REDUCE_OPS,
    row_sum=ROW_SUM_OPS,
    max_row=16384,  # a row reduction keeps one row in a stack buffer (64 KiB)
)


@dataclass(frozen=True)
class Spelling:
    """How a generator writes the formulas of FUSIBLE's ops: a template per unary (and
    other fixed-form) op, the two binary operator tables, GELU's two forms, a select and
    a float literal. C++ here, Triton in codegen/triton/render.py."""

    unary: dict
    arithmetic: dict
    compare: dict
    gelu_erf: str
    gelu_tanh: str
    select: str                 # "{c}", "{a}", "{b}": c ? a : b
    float_suffix: str = ""


def formula(node: Node, a: list[str], spelling: Spelling) -> str:
    op = node.op
    binary = spelling.arithmetic.get(op) or spelling.compare.get(op)
    if binary:
        return f"({a[0]} {binary} {a[1]})"
    if op in spelling.unary:
        return spelling.unary[op].format(*a)
    if op == "gelu":
        form = spelling.gelu_tanh if node.attrs["approximate"] == "tanh" else spelling.gelu_erf
        return form.format(a[0])
    if op == "clamp":
        x = a[0]
        lo, hi = node.attrs["min"], node.attrs["max"]
        if lo is not None:
            lit = f"{float(lo)!r}{spelling.float_suffix}"
            x = spelling.select.format(c=f"{x} < {lit}", a=lit, b=x)
        if hi is not None:
            lit = f"{float(hi)!r}{spelling.float_suffix}"
            x = spelling.select.format(c=f"{x} > {lit}", a=lit, b=x)
        return x
    raise NotImplementedError(f"no formula for {op}")


CPP = Spelling(
    _UNARY, _ARITHMETIC, _COMPARE,
    gelu_erf="(0.5f * {0} * (1.0f + ow_erf({0} * 0.7071067811865476f)))",
    gelu_tanh=("(0.5f * {0} * (1.0f + ow_tanh(0.7978845608028654f * "
               "({0} + 0.044715f * {0} * {0} * {0}))))"),
    select="({c} ? {a} : {b})", float_suffix="f")


def _ctype(v: Value) -> str:
    return "const bool*" if v.type.dtype == torch.bool else "const float*"


def render(graph: Graph, members: list[Node], escapes, schedule=None,
           low: tuple[frozenset[int], frozenset[int]] | None = None,
           twins: tuple[tuple[int, Value], ...] = ()) -> KernelSource:
    """C++ for `members` (in graph order); `escapes(value)` says which values it writes.
    `schedule` (codegen/kernel_schedule.KernelSchedule; None: the default) sets its
    threads, vector width and unrolling; the default's source and name never change.
    `low`: (input positions, output positions) its functions read and write in bfloat16,
    computing in float32 as ever: a bf16 step's result comes in as it is, widened in
    registers (exactly what widening it first gives), and a result only bf16 steps read
    goes out rounded as they would round it, so the form computes the same values and
    moves fewer bytes, with no conversions around it (codegen/precision.hand_off_in_bf16
    says which). `twins`: (output position, value) pairs: each output is also written
    rounded to bfloat16 into its value, after the group's outputs (a result that float32
    steps read and bf16 products read too, each in its type)."""
    em = GroupEmitter(graph, members, escapes)
    low_in, low_out = low or (frozenset(), frozenset())
    reduce = next((n for n in members if n.op in ROW_REDUCE_OPS | ROW_SUM_OPS), None)
    threads = "auto" if schedule is None else schedule.threads
    attributes = "" if schedule is None else schedule.attributes()
    dense = channels_last_dense_inputs(em, reduce)
    functions = []
    for walked in (False, True) if dense is not None else (False,):
        emitter = GroupEmitter(graph, members, escapes, channels_last=walked) if walked else em
        emitter.in_bf16(low_in, low_out, twins)
        functions.append(_function(emitter, members, reduce if not walked else None, threads))
    digest = hashlib.sha256("\n".join(functions[0]).encode() + attributes.encode()).hexdigest()[:16]
    name = f"ow_k_{digest}"
    src = "".join(f'extern "C" {attributes}void {name}{suffix}(void** args) {{\n'
                  + "\n".join(lines) + "\n}\n"
                  for suffix, lines in zip(("", "_cl"), functions))
    extra = {}
    if dense is not None:
        extra = dict(channels_last_name=f"{name}_cl", channels_last_out=True, dense_inputs=dense)
    return KernelSource(name, src, em.inputs, em.outputs, em.elementwise, _node_lines(em, src),
                        low_inputs=frozenset(low_in),
                        low_outputs=frozenset(low_out) | frozenset(
                            range(len(em.outputs) - len(twins), len(em.outputs))),
                        twins=tuple(p for p, _ in twins), schedule=schedule, **extra)


def channels_last_dense_inputs(em: GroupEmitter, reduce) -> tuple[int, ...] | None:
    """Where a 4-D group without reductions broadcasts some input (a per-channel scale,
    shift or gate), the positions of its full-shape inputs: walked as N, H, W, C, the
    kernel reads those channels-last and the others in place, and writes channels-last.
    None where that is not so: an input broadcast both along the channels and along a
    spatial axis ([1, C, H, 1]) is not in the walk's order in memory."""
    if reduce is not None or em.elementwise or len(em.shape) != 4 or not em.inputs:
        return None
    if any(tuple(v.type.shape) != em.shape for v in em.outputs):
        return None
    dense = []
    for i, v in enumerate(em.inputs):
        shape = (1,) * (4 - v.type.rank) + tuple(v.type.shape)
        if shape == em.shape:
            dense.append(i)
        elif shape[1] != 1 and shape[2:] != (1, 1):
            return None
    return tuple(dense) or None


def _function(em: GroupEmitter, members, reduce, threads: str) -> list[str]:
    """The lines of one kernel function's body."""
    lines = []
    for i, v in enumerate(em.outputs):
        out_type = "uint16_t*" if v in em.low_outputs else "float*"
        lines.append(f"  {out_type} __restrict a{i} = ({out_type})args[{i}];")
    for v in em.inputs:
        ctype = "const uint16_t*" if v in em.low_inputs else _ctype(v)
        lines.append(f"  {ctype} __restrict {em.arg(v)} = ({ctype})args[{em.outputs.__len__() + em.inputs.index(v)}];")
    total = em.rows * em.cols
    par = _parallel(threads, f"{total} >= {PARALLEL_MIN} && {em.rows} > 1", f"{em.rows} > 1")
    if em.elementwise:
        body = _loop(em, members, "j")
        flat = _parallel(threads, f"{total} >= {PARALLEL_MIN}", None)
        if flat is not None:
            body[0] = f"#pragma omp parallel for simd {flat}"
        lines += ["  " + ln for ln in body]
    elif reduce is None:
        body = _loop(em, members, "r * {c} + j".format(c=em.cols))
        lines += _parallel_for(par)
        lines.append(f"  for (int64_t r = 0; r < {em.rows}; ++r) {{")
        lines += ["    " + ln for ln in body]
        lines.append("  }")
    elif is_column_sum(reduce):
        lines += _column_sum_kernel(em, members, reduce, total, threads)
    elif reduce.op in ROW_SUM_OPS:
        lines += _row_sum_kernel(em, members, reduce, par)
    else:
        lines += _row_kernel(em, members, reduce, par)
    return lines


def _condition(threads: str, auto: str, team: str | None) -> str | None:
    """When a loop runs on the thread team under a schedule's `threads`: the `auto`
    condition, the `team` one ("" for always, where it is None), or None ("one": never)."""
    if threads == "one":
        return None
    return auto if threads == "auto" else (team or "")


def _parallel(threads: str, auto: str, team: str | None) -> str | None:
    """The OpenMP clauses of a row loop's parallel region (None: no region at all)."""
    condition = _condition(threads, auto, team)
    if condition is None:
        return None
    return "num_threads(ow_team())" + (f" if({condition})" if condition else "")


def _parallel_for(par: str | None) -> list[str]:
    return [] if par is None else [f"  #pragma omp parallel for {par}"]


def _node_lines(em, src: str) -> dict:
    lines = src.splitlines()
    found = {}
    for node in em.members:
        declared = f" {em.names[node.outputs[0]]} = "
        found[node] = next((i for i, text in enumerate(lines, 1) if declared in text), 0)
    return found


def _stores(em, nodes, at: str) -> list[str]:
    def spelled(v, written):
        return f"ow_bf16_round({em.names[v]})" if written in em.low_outputs else em.names[v]
    return [f"a{em.outputs.index(w)}[{at}] = {spelled(n.outputs[0], w)};"
            for n in nodes for w in (n.outputs[0], *em.twins.get(n.outputs[0], ()))
            if w in em.outputs]


def _loop(em, nodes, at) -> list[str]:
    out = ["#pragma omp simd", f"for (int64_t j = 0; j < {em.cols}; ++j) {{"]
    for n in nodes:
        out.append("  " + em.declare(n))
    out += ["  " + s for s in _stores(em, nodes, at)]
    out.append("}")
    return out


def _row_kernel(em, members, reduce, par) -> list[str]:
    c = em.cols
    before = [n for n in members if n is not reduce and reaches(n, reduce, set(members))]
    after = [n for n in members if n is not reduce and n not in before]
    x = reduce.inputs[0]
    y = em.names[reduce.outputs[0]]
    lines = [*_parallel_for(par), f"  for (int64_t r = 0; r < {em.rows}; ++r) {{",
             f"    float buf[{c}];", "    #pragma omp simd", f"    for (int64_t j = 0; j < {c}; ++j) {{"]
    for n in before:
        lines.append("      " + em.declare(n))
    lines.append(f"      buf[j] = {em.load(x)};")
    lines += ["      " + s for s in _stores(em, before, f"r * {c} + j")]
    lines.append("    }")
    if reduce.op == "layer_norm":
        w, b = (em.load(v) for v in reduce.inputs[1:])
        eps = float(reduce.attrs["eps"])
        # Mean, then the centered variance, both accumulated in double: a float mean of
        # nearly equal large values is off by a few ulps, and 1/sqrt(eps) magnifies that
        # into outputs far from 0. Two vectorized passes over the row buffer. The mean is
        # subtracted as a float pair (hi + lo): buf - hi is exact for values near it.
        lines += ["    double sum = 0.0;", "    #pragma omp simd reduction(+:sum)",
                  f"    for (int64_t j = 0; j < {c}; ++j) sum += (double)buf[j];",
                  f"    const double mean_d = sum / {c}.0;", "    double sq = 0.0;",
                  "    #pragma omp simd reduction(+:sq)",
                  f"    for (int64_t j = 0; j < {c}; ++j) {{ double d = (double)buf[j] - mean_d; sq += d * d; }}",
                  "    const float mean = (float)mean_d;",
                  "    const float mean_lo = (float)(mean_d - (double)mean);",
                  f"    const float rstd = (float)(1.0 / std::sqrt(sq / {c}.0 + (double){eps!r}f));"]
        value = f"((buf[j] - mean) - mean_lo) * rstd * {w} + {b}"
    else:
        lines += ["    float mx = -INFINITY;", "    #pragma omp simd reduction(max:mx)",
                  f"    for (int64_t j = 0; j < {c}; ++j) mx = buf[j] > mx ? buf[j] : mx;",
                  "    float sum = 0.0f;", "    #pragma omp simd reduction(+:sum)"]
        if reduce.op == "softmax":
            lines += [f"    for (int64_t j = 0; j < {c}; ++j) {{ buf[j] = ow_exp(buf[j] - mx); sum += buf[j]; }}",
                      "    const float inv = 1.0f / sum;"]
            value = "buf[j] * inv"
        else:
            lines += [f"    for (int64_t j = 0; j < {c}; ++j) sum += ow_exp(buf[j] - mx);",
                      "    const float lse = mx + std::log(sum);"]
            value = "buf[j] - lse"
    lines += ["    #pragma omp simd", f"    for (int64_t j = 0; j < {c}; ++j) {{"]
    for n in before:  # recomputed where the epilogue reads them; dead code otherwise
        lines.append("      " + em.declare(n))
    lines.append(f"      const float {y} = {value};")
    for n in after:
        lines.append("      " + em.declare(n))
    lines += ["      " + s for s in _stores(em, [reduce] + after, f"r * {c} + j")]
    lines += ["    }", "  }"]
    return lines


def _row_sum_kernel(em, members, reduce, par) -> list[str]:
    """Prologue and sum in one pass over the row (no buffer); the epilogue, if any, in a
    second pass that recomputes the prologue values it reads."""
    c = em.cols
    before = [n for n in members if n is not reduce and reaches(n, reduce, set(members))]
    after = [n for n in members if n is not reduce and n not in before]
    y = em.names[reduce.outputs[0]]
    lines = [*_parallel_for(par), f"  for (int64_t r = 0; r < {em.rows}; ++r) {{",
             "    float acc = 0.0f;", "    #pragma omp simd reduction(+:acc)",
             f"    for (int64_t j = 0; j < {c}; ++j) {{"]
    for n in before:
        lines.append("      " + em.declare(n))
    lines.append(f"      acc += {em.load(reduce.inputs[0])};")
    lines += ["      " + s for s in _stores(em, before, f"r * {c} + j")]
    lines.append("    }")
    total = f" / {c}.0f" if reduce.op == "mean" else ""
    lines.append(f"    const float {y} = acc{total};")
    lines += ["    " + s for s in _stores(em, [reduce], "r")]
    if after:
        lines += ["    #pragma omp simd", f"    for (int64_t j = 0; j < {c}; ++j) {{"]
        for n in before + after:  # prologue values recomputed; unread ones are dead code
            lines.append("      " + em.declare(n))
        lines += ["      " + s for s in _stores(em, after, f"r * {c} + j")]
        lines.append("    }")
    lines.append("  }")
    return lines


def _column_sum_kernel(em, members, reduce, total, threads: str = "auto") -> list[str]:
    """The other members and the sum's accumulation in one pass over the rows. The rows
    are cut into `nt` blocks, each summed into its own slice of `part`, and the slices
    are added in block order after: which thread ran which block cannot change a bit."""
    c, rows = em.cols, em.rows
    others = [n for n in members if n is not reduce]
    out = f"a{em.outputs.index(reduce.outputs[0])}"
    condition = _condition(threads, f"{total} >= {PARALLEL_MIN} && {rows} > 1", f"{rows} > 1")
    team = "1" if condition is None else f"({condition}) ? ow_team() : 1"
    lines = [f"  const int nt = {team};",
             f"  std::vector<float> part((size_t)nt * {c}, 0.0f);",
             *(["  #pragma omp parallel for num_threads(nt) schedule(static, 1)"]
               if condition is not None else []),
             "  for (int t = 0; t < nt; ++t) {",
             f"    float* __restrict acc = part.data() + (size_t)t * {c};",
             f"    for (int64_t r = {rows} * t / nt; r < {rows} * (t + 1) / nt; ++r) {{",
             "      #pragma omp simd",
             f"      for (int64_t j = 0; j < {c}; ++j) {{"]
    lines += ["        " + em.declare(n) for n in others]
    lines.append(f"        acc[j] += {em.load(reduce.inputs[0])};")
    lines += ["        " + s for s in _stores(em, others, f"r * {c} + j")]
    lines += ["      }", "    }", "  }", f"  std::memcpy({out}, part.data(), {c} * sizeof(float));",
              "  for (int t = 1; t < nt; ++t) {", "    #pragma omp simd",
              f"    for (int64_t j = 0; j < {c}; ++j) {out}[j] += part[(size_t)t * {c} + j];", "  }"]
    return lines


def reaches(node: Node, target: Node, inside: set[Node]) -> bool:
    """Whether `node` feeds `target` through members of the group."""
    stack, seen = [target], set()
    while stack:
        n = stack.pop()
        for v in n.inputs:
            p = v.producer
            if p is node:
                return True
            if p in inside and p not in seen:
                seen.add(p)
                stack.append(p)
    return False
