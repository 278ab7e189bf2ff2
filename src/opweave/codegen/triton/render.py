"""Render one fused group as a Triton kernel: the groups the partitioner forms for the C++
generator (codegen/render.FUSIBLE), spelled for a GPU.

The iteration space is rows (all axes but the last) by columns (the last axis), as in C++.
Each program instance takes a tile of `BR` rows by `BC` columns; every input is read in
place through its broadcast strides (the same index formulas the C++ kernels use, sizes
baked in), so a bias or a per-channel scale costs no copy.
- pointwise: one tile per program over a 1-D grid (row block, column block);
- row reduction (softmax, log-softmax, layer norm): a program holds `BR` whole rows
  (`BC` is the row padded to a power of two), reduces and runs the epilogue in registers;
  layer norm's mean and variance are taken in float64, as the C++ kernel does;
- row sum (sum or mean over the last axis, kept): the same, storing one value per row;
- column sum: each program sums a slice of the rows for `BC` columns into its own row of
  a partial-sum buffer, and the launcher adds those rows in order (deterministic).
Kernel arguments: outputs, then inputs (contiguous), then a column sum's partial buffer.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch

from ...ir.graph import Node, Value
from ...partition.classify import is_column_sum
from ..render import ROW_REDUCE_OPS, ROW_SUM_OPS, GroupEmitter, Spelling, formula, reaches

KINDS = ("pointwise", "row", "row_sum", "column_sum", "gemm")


@dataclass
class TritonSource:
    name: str
    body: str                 # a Python module: imports and one @triton.jit function
    inputs: list[Value]
    outputs: list[Value]
    kind: str                 # one of KINDS
    rows: int
    cols: int
    reduced: Value | None = None   # a column sum's output (written through the partials)
    node_lines: dict = field(default_factory=dict)


_ARITHMETIC = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_UNARY = {
    "neg": "({0} * -1.0)",  # (Triton negates as 0 - x: -0.0 would be lost)
    "abs": "tl.abs({0})", "exp": "tl.exp({0})", "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "(1.0 / tl.sqrt_rn({0}))", "reciprocal": "(1.0 / {0})",
    "sigmoid": "ow_sigmoid({0})", "tanh": "ow_tanh({0})", "erf": "tl.erf({0})",
    "relu": "tl.where({0} < 0.0, 0.0, {0})",
    "sign": "(tl.where({0} > 0.0, 1.0, 0.0) - tl.where({0} < 0.0, 1.0, 0.0))",
    "ceil": "tl.ceil({0})", "floor": "tl.floor({0})",
    "maximum": "tl.where(({0} > {1}) | ({0} != {0}), {0}, {1})",
    "minimum": "tl.where(({0} < {1}) | ({0} != {0}), {0}, {1})",
    "where": "tl.where({0}, {1}, {2})", "pow": "ow_pow({0}, {1})",
}


TRITON = Spelling(
    _UNARY, _ARITHMETIC, _COMPARE,
    gelu_erf="(0.5 * {0} * (1.0 + tl.erf({0} * 0.7071067811865476)))",
    gelu_tanh=("(0.5 * {0} * (1.0 + ow_tanh(0.7978845608028654 * "
               "({0} + 0.044715 * {0} * {0} * {0}))))"),
    select="tl.where({c}, {a}, {b})")


# Exponents spelled as products, divisions and correctly rounded roots: pow's result to
# an ulp (its IEEE special cases kept: pow(-inf, 0.5) is inf, pow(-0.0, -0.5) is inf)
_POWERS = {
    1.0: "({0})", 2.0: "({0} * {0})", 3.0: "({0} * {0} * {0})", -1.0: "(1.0 / {0})",
    -2.0: "(1.0 / ({0} * {0}))",
    0.5: 'tl.where({0} == -float("inf"), float("inf"), tl.sqrt_rn({0}))',
    -0.5: ('tl.where({0} == -float("inf"), 0.0, '
           'tl.where({0} == 0.0, float("inf"), 1.0 / tl.sqrt_rn({0})))'),
}


def _number(text: str | None) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):  # no literal, or NaN / infinity spelled as a call
        return None


def _literal(text: str) -> str:
    """A C++ float literal as Python source."""
    return {"NAN": 'float("nan")', "INFINITY": 'float("inf")',
            "(-INFINITY)": '(-float("inf"))'}.get(text, text.rstrip("f"))


class TritonEmitter(GroupEmitter):
    int_div = "//"

    def __init__(self, graph, members, escapes):
        super().__init__(graph, members, escapes)
        self.literals = {v: _literal(t) for v, t in self.literals.items()}

    def element(self, v: Value) -> str:
        return f"tl.load({self.arg(v)} + {self.offset(v)}, mask=m, other=0)"

    def index(self, v: Value) -> str:
        if not self.elementwise and _same_rows(v.type.shape, self.shape) \
                and tuple(v.type.shape) != tuple(self.shape):
            return f"r * {self.cols} + j"  # full size past a reshape: the same flat layout
        return super().index(v)

    def offset(self, v: Value) -> str:
        """The input's element offsets as a full [BR, BC] tile (tl.load broadcasts the
        mask to the pointers' shape, not the other way)."""
        index = self.index(v)
        return index if index == "j" else f"({index}) + zero"

    def declare(self, node: Node) -> str:
        if node.op == "reshape":  # rows x columns unchanged: the same tile
            return f"{self.names[node.outputs[0]]} = {self.load(node.inputs[0])}"
        args = [self.load(v) for v in node.inputs]
        name = self.names[node.outputs[0]]
        if node.op == "pow":
            exponent = _number(self.literals.get(node.inputs[1]))
            if exponent in _POWERS:  # as torch spells them
                return f"{name} = " + _POWERS[exponent].format(args[0])
            # ow_pow's tests need tensors: a literal becomes a full tile
            args = [f"tl.full(m.shape, {a}, tl.float32)" if v in self.literals else a
                    for v, a in zip(node.inputs, args)]
        return f"{name} = {formula(node, args, TRITON)}"

    def stores(self, nodes, at: str = "r * {c} + j", mask: str = "m") -> list[str]:
        at = at.format(c=self.cols)
        return [f"tl.store(a{self.outputs.index(n.outputs[0])} + {at}, {self.names[n.outputs[0]]}, "
                f"mask={mask})" for n in nodes if n.outputs[0] in self.outputs]


_HEADER = ("import triton\nimport triton.language as tl\n"
           "from opweave.codegen.triton.mathlib import ow_pow, ow_sigmoid, ow_tanh\n\n\n")


def render(graph, members: list[Node], escapes) -> TritonSource:
    """Triton for `members` (in graph order); `escapes(value)` says which values it writes."""
    em = TritonEmitter(graph, members, escapes)
    reduce = next((n for n in members if n.op in ROW_REDUCE_OPS | ROW_SUM_OPS), None)
    if reduce is None:
        kind, lines = "pointwise", _pointwise(em, members)
    elif is_column_sum(reduce):
        kind, lines = "column_sum", _column_sum(em, members, reduce)
    elif reduce.op in ROW_SUM_OPS:
        kind, lines = "row_sum", _row_sum(em, members, reduce)
    else:
        kind, lines = "row", _row(em, members, reduce)
    args = [f"a{i}" for i in range(len(em.outputs) + len(em.inputs))]
    if kind == "column_sum":
        args += ["part", "NT: tl.constexpr", "TRIPS: tl.constexpr"]
    signature = ", ".join(args + ["BR: tl.constexpr", "BC: tl.constexpr"])
    text = "\n".join(lines)
    name = "ow_t_" + hashlib.sha256(f"{signature}\n{text}".encode()).hexdigest()[:16]
    body = f"{_HEADER}@triton.jit\ndef {name}({signature}):\n" + "\n".join(
        "    " + ln for ln in lines) + "\n"
    reduced = reduce.outputs[0] if kind == "column_sum" else None
    return TritonSource(name, body, em.inputs, em.outputs, kind, em.rows, em.cols, reduced,
                        _node_lines(em, body))


def _tile(em) -> list[str]:
    """Program p takes row block p // NCB and column block p % NCB."""
    return [f"NCB = {_cdiv_text(em.cols)}",
            "pid = tl.program_id(0).to(tl.int64)",  # offsets past 2**31 elements
            "r = (pid // NCB * BR + tl.arange(0, BR))[:, None]",
            "j = (pid % NCB * BC + tl.arange(0, BC))[None, :]",
            "zero = tl.zeros((BR, BC), tl.int64)",
            f"m = (r < {em.rows}) & (j < {em.cols})"]


def _row_tile(em) -> list[str]:
    """Program p takes rows [p * BR, (p + 1) * BR), each whole (BC >= the row)."""
    return ["r = (tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR))[:, None]",
            "j = tl.arange(0, BC).to(tl.int64)[None, :]",
            "zero = tl.zeros((BR, BC), tl.int64)",
            f"m = (r < {em.rows}) & (j < {em.cols})"]


def _cdiv_text(cols: int) -> str:
    return f"({cols} + BC - 1) // BC"


def _pointwise(em, members) -> list[str]:
    lines = _tile(em)
    lines += [em.declare(n) for n in members]
    at = "j" if em.rows == 1 else "r * {c} + j"
    return lines + em.stores(members, at)


def _split(members, reduce):
    inside = set(members)
    before = [n for n in members if n is not reduce and reaches(n, reduce, inside)]
    after = [n for n in members if n is not reduce and n not in before]
    return before, after


def _row(em, members, reduce) -> list[str]:
    """Whole rows in registers: prologue, statistic, epilogue."""
    c = em.cols
    before, after = _split(members, reduce)
    y = em.names[reduce.outputs[0]]
    lines = _row_tile(em) + [em.declare(n) for n in before]
    lines.append(f"x = {em.load(reduce.inputs[0])}")
    lines += em.stores(before)
    if reduce.op == "layer_norm":
        w, b = (em.load(v) for v in reduce.inputs[1:])
        eps = float(reduce.attrs["eps"])
        lines += ["xd = tl.where(m, x, 0.0).to(tl.float64)",
                  f"mean_d = tl.sum(xd, 1)[:, None] / {c}.0",
                  "d = tl.where(m, xd - mean_d, 0.0)",
                  f"var = tl.sum(d * d, 1)[:, None] / {c}.0",
                  "mean = mean_d.to(tl.float32)",
                  "mean_lo = (mean_d - mean.to(tl.float64)).to(tl.float32)",
                  f"rstd = (1.0 / tl.sqrt(var + {eps!r})).to(tl.float32)",
                  f"{y} = ((x - mean) - mean_lo) * rstd * {w} + {b}"]
    else:
        lines += ['mx = tl.max(tl.where(m, x, -float("inf")), 1)[:, None]',
                  "e = tl.where(m, tl.exp(x - mx), 0.0)",
                  "s = tl.sum(e, 1)[:, None]"]
        lines.append(f"{y} = e / s" if reduce.op == "softmax" else f"{y} = x - (mx + tl.log(s))")
    lines += [em.declare(n) for n in after]
    return lines + em.stores([reduce] + after)


def _row_sum(em, members, reduce) -> list[str]:
    c = em.cols
    before, after = _split(members, reduce)
    y = em.names[reduce.outputs[0]]
    lines = _row_tile(em) + [em.declare(n) for n in before]
    lines += em.stores(before)
    total = f" / {c}.0" if reduce.op == "mean" else ""
    lines.append(f"{y} = tl.sum(tl.where(m, {em.load(reduce.inputs[0])}, 0.0), 1)[:, None]{total}")
    lines += em.stores([reduce], at="r", mask=f"r < {em.rows}")
    lines += [em.declare(n) for n in after]
    return lines + em.stores(after)


def _column_sum(em, members, reduce) -> list[str]:
    """Program (t, column block) sums rows [t*R/NT, (t+1)*R/NT) into part[t], in TRIPS
    tiles of BR rows."""
    rows, c = em.rows, em.cols
    others = [n for n in members if n is not reduce]
    lines = [f"NCB = {_cdiv_text(c)}",
             "pid = tl.program_id(0).to(tl.int64)",
             "t = pid // NCB",
             "j = (pid % NCB * BC + tl.arange(0, BC))[None, :]",
             "zero = tl.zeros((BR, BC), tl.int64)",
             f"lo = t * {rows} // NT",
             f"hi = (t + 1) * {rows} // NT",
             "acc = tl.zeros((BR, BC), tl.float32)",
             "for k in range(0, TRIPS):",  # constant trip count: the interpreter needs one
             "    r = (lo + k * BR + tl.arange(0, BR))[:, None]",
             f"    m = (r < hi) & (j < {c})"]
    body = [em.declare(n) for n in others]
    body.append(f"acc += tl.where(m, {em.load(reduce.inputs[0])}, 0.0)")
    body += em.stores(others)
    lines += ["    " + ln for ln in body]
    lines.append(f"tl.store(part + t * {c} + j, tl.sum(acc, 0)[None, :], mask=j < {c})")
    return lines


def _node_lines(em, body: str) -> dict:
    lines = body.splitlines()
    found = {}
    for node in em.members:
        declared = f"{em.names[node.outputs[0]]} = "
        found[node] = next((i for i, text in enumerate(lines, 1)
                            if text.strip().startswith(declared)), 0)
    return found


def _same_rows(shape, full) -> bool:
    """Whether `shape` is `full` with its leading axes regrouped (same size, same last
    axis): what a reshape inside an epilogue leaves."""
    return (len(shape) > 0 and len(full) > 0 and shape[-1] == full[-1]
            and math.prod(shape) == math.prod(full))


def keeps_rows(node: Node) -> bool:
    """A reshape that only regroups the leading axes: free inside a kernel."""
    return node.op == "reshape" and _same_rows(node.outputs[0].type.shape, node.inputs[0].type.shape)


def dtype_ok(members: list[Node]) -> bool:
    """Every value the group touches is float32 or bool (what the formulas are for)."""
    return all(v.type.dtype in (torch.float32, torch.bool)
               for n in members for v in [*n.inputs, *n.outputs])
