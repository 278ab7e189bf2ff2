"""The textual form of a graph: a printer and a parser that round-trip exactly.

    graph @name(%x: f32[1,16], %ids: i64[1,8]) {
      %w: f32[16,4] = constant() {name="w", shape=[16,4], dtype=f32}
      %y: f32[1,4] = matmul(%x, %w) loc("model.linear")
      return %y
    }

Attributes are printed in the op's declared order, defaults included; floats use repr
(so they parse back bit for bit); dtypes are bare names; strings are JSON-quoted.
Constant data is not part of the text: pass `constants=` to the parser to bind it.
"""
from __future__ import annotations

import json
import re

import torch

from . import dtypes, symbols
from .graph import Graph, Value
from .types import TensorType


class ParseError(ValueError):
    """Malformed graph text; the message gives the line number and what was expected."""


# -- printing -----------------------------------------------------------------------------
def format_attr(value) -> str:
    if symbols.is_symbolic(value):
        return f'?"{symbols.to_text(value)}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, torch.dtype):
        return dtypes.name_of(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_attr(v) for v in value) + "]"
    raise TypeError(f"cannot print attribute value {value!r} ({type(value).__name__})")


def _typed(value: Value) -> str:
    return f"%{value.name}: {value.type}"


def print_graph(graph: Graph) -> str:
    bound = f" symbols({', '.join(graph.symbols)})" if graph.symbols else ""
    lines = [f"graph @{graph.name}(" + ", ".join(_typed(v) for v in graph.inputs) + f"){bound} {{"]
    for node in graph.nodes:
        line = "  " + ", ".join(_typed(v) for v in node.outputs)
        line += f" = {node.op}(" + ", ".join("%" + v.name for v in node.inputs) + ")"
        if node.attrs:
            line += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in node.attrs.items()) + "}"
        if node.source:
            line += f" loc({json.dumps(node.source)})"
        lines.append(line)
    lines.append("  return " + ", ".join("%" + v.name for v in graph.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- parsing ------------------------------------------------------------------------------
_TOKEN = re.compile(r"""\s*(?:
    (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<num>-?(?:inf|nan|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?))(?![A-Za-z0-9_])
  | (?P<value>%[A-Za-z0-9_.]+)
  | (?P<id>@?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[\[\](){},=:?])
)""", re.VERBOSE)


class _Cursor:
    def __init__(self, text: str, line_no: int):
        self.tokens: list[tuple[str, str]] = []
        self.line_no = line_no
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                self.fail(f"unexpected text {text[pos:pos + 20]!r}")
            kind = m.lastgroup
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def fail(self, message: str):
        raise ParseError(f"line {self.line_no}: {message}")

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str | None = None, text: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (kind and tok[0] != kind) or (text and tok[1] != text):
            want = text or kind
            self.fail(f"expected {want}, found {tok[1] if tok else 'end of line'!r}")
        self.i += 1
        return tok[1]

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok and tok[1] == text:
            self.i += 1
            return True
        return False

    def done(self) -> None:
        if self.peek() is not None:
            self.fail(f"unexpected {self.peek()[1]!r} at end of line")

    def type(self) -> TensorType:
        name = self.take("id")
        self.take(text="[")
        shape = []
        while not self.accept("]"):
            shape.append(self.dim())
            self.accept(",")
        try:
            return TensorType(tuple(shape), dtypes.to_torch(name))
        except ValueError as err:
            self.fail(str(err))

    def dim(self):
        """`128`, a symbol `s0`, or an expression `?"128*s0"` (ir.symbols)."""
        kind, text = self.peek() or ("", "")
        if kind == "num":
            return int(self.take("num"))
        if kind == "id":
            return symbols.parse(self.take("id"))
        return self.symbolic()

    def symbolic(self):
        self.take(text="?")
        try:
            return symbols.parse(json.loads(self.take("str")))
        except symbols.SymbolError as err:
            self.fail(str(err))

    def attr_value(self):
        kind, text = self.peek() or ("", "")
        if text == "?":
            return self.symbolic()
        if text == "[":
            self.take()
            items = []
            while not self.accept("]"):
                items.append(self.attr_value())
                self.accept(",")
            return items
        self.take()
        if kind == "str":
            return json.loads(text)
        if kind == "num":
            if any(c in text for c in ".eE") or text.lstrip("-") in ("inf", "nan"):
                return float(text)
            return int(text)
        if kind == "id":
            if text in ("true", "false"):
                return text == "true"
            if text == "none":
                return None
            if text in dtypes.DTYPE_NAMES:
                return dtypes.to_torch(text)
        self.fail(f"bad attribute value {text!r}")


def parse_graph(text: str, constants: dict[str, torch.Tensor] | None = None) -> Graph:
    """Parse the text form. Types are taken as declared; run `verify` to check them."""
    lines = [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    if not lines:
        raise ParseError("empty graph text")
    line_no, header = lines[0]
    cur = _Cursor(header, line_no)
    if cur.take("id") != "graph":
        cur.fail("expected 'graph'")
    name = cur.take("id")
    if not name.startswith("@"):
        cur.fail("expected @name after 'graph'")
    graph = Graph(name[1:])
    values: dict[str, Value] = {}
    cur.take(text="(")
    while not cur.accept(")"):
        vname = cur.take("value")[1:]
        cur.take(text=":")
        value = graph.add_input(vname, cur.type())
        if value.name != vname:
            cur.fail(f"value %{vname} is defined twice")
        values[vname] = value
        cur.accept(",")
    if cur.accept("symbols"):
        cur.take(text="(")
        while not cur.accept(")"):
            graph.symbols.append(cur.take("id"))
            cur.accept(",")
    cur.take(text="{")
    cur.done()

    if lines[-1][1].strip() != "}":
        raise ParseError(f"line {lines[-1][0]}: expected '}}' closing the graph")
    returned = False
    for line_no, line in lines[1:-1]:
        cur = _Cursor(line, line_no)
        if returned:
            cur.fail("nothing may follow 'return'")
        if cur.peek() == ("id", "return"):
            cur.take()
            while cur.peek() is not None:
                graph.outputs.append(_lookup(cur, values))
                cur.accept(",")
            returned = True
            continue
        _parse_node(cur, graph, values)
    if not returned:
        raise ParseError("the graph has no 'return' line")
    graph.constants.update(constants or {})
    return graph


def _lookup(cur: _Cursor, values: dict[str, Value]) -> Value:
    name = cur.take("value")[1:]
    if name not in values:
        cur.fail(f"value %{name} is used before it is defined")
    return values[name]


def _parse_node(cur: _Cursor, graph: Graph, values: dict[str, Value]) -> None:
    outs: list[tuple[str, TensorType]] = []
    while True:
        oname = cur.take("value")[1:]
        cur.take(text=":")
        outs.append((oname, cur.type()))
        if not cur.accept(","):
            break
    cur.take(text="=")
    op = cur.take("id")
    cur.take(text="(")
    inputs = []
    while not cur.accept(")"):
        inputs.append(_lookup(cur, values))
        cur.accept(",")
    attrs = {}
    if cur.accept("{"):
        while not cur.accept("}"):
            key = cur.take("id")
            cur.take(text="=")
            attrs[key] = cur.attr_value()
            cur.accept(",")
    source = ""
    if cur.accept("loc"):
        cur.take(text="(")
        source = json.loads(cur.take("str"))
        cur.take(text=")")
    cur.done()
    try:
        node_outs = graph.add(op, inputs, attrs, types=[t for _, t in outs], source=source)
    except (KeyError, ValueError) as err:
        cur.fail(str(err.args[0]) if err.args else type(err).__name__)
    for (oname, _), value in zip(outs, node_outs):
        if oname in values:
            cur.fail(f"value %{oname} is defined twice")
        graph.rename(value, oname)
        values[oname] = value
