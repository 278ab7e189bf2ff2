"""The text form round-trips exactly on every model's IR; so does the JSON form."""
from __future__ import annotations

import math

import pytest
import torch

from opweave.ir import Graph, ParseError, TensorType, parse_graph, print_graph, verify
from opweave.ir import serialize

from ..conftest import MODEL_NAMES, compiled_small


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_ir_round_trips_through_text_and_json(name):
    (graph,) = compiled_small(name).graphs
    text = print_graph(graph)
    again = parse_graph(text, graph.constants)
    verify(again)
    assert print_graph(again) == text
    from_json = serialize.from_json(serialize.to_json(graph), graph.constants)
    verify(from_json)
    assert print_graph(from_json) == text


def _odd_attrs_graph():
    g = Graph("odd")
    x = g.add_input("x", TensorType((2, 3), torch.float32))
    y = g.add1("clamp", [x], {"min": -math.inf, "max": 0.1 + 0.2})
    z = g.add1("full", [], {"shape": [], "value": 1e-300, "dtype": torch.float64})
    w = g.add1("div", [y, g.add1("cast", [z], {"dtype": torch.float32})], {"rounding": "floor"},
               source='model.py:3 "quoted" {braces}')
    g.outputs = [w, z]
    return verify(g)


def test_round_trip_keeps_floats_strings_and_sources_exact():
    g = _odd_attrs_graph()
    text = print_graph(g)
    assert print_graph(parse_graph(text)) == text
    parsed = parse_graph(text)
    assert parsed.nodes[0].attrs["max"] == 0.1 + 0.2
    assert parsed.nodes[0].attrs["min"] == -math.inf
    assert parsed.nodes[-1].source == 'model.py:3 "quoted" {braces}'
    assert print_graph(serialize.from_json(serialize.to_json(g))) == text


def test_save_and_load_keep_constants(tmp_path):
    (graph,) = compiled_small("xmlcnn").graphs
    serialize.save(graph, tmp_path / "g.json")
    loaded = serialize.load(tmp_path / "g.json")
    verify(loaded)
    assert print_graph(loaded) == print_graph(graph)
    assert all(torch.equal(loaded.constants[k], v) for k, v in graph.constants.items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json", "g.json.pt"]


@pytest.mark.parametrize("text, message", [
    ("", "empty graph text"),
    ("graph @g(%x: f32[2]) {\n  return %x\n", "expected '}'"),
    ("graph @g(%x: f32[2]) {\n  %y: f32[2] = relu(%z)\n  return %y\n}", "line 2: value %z is used before"),
    ("graph @g(%x: f32[2]) {\n  %y: f32[2] = frobnicate(%x)\n  return %y\n}", "line 2: unknown op 'frobnicate'"),
    ("graph @g(%x: q7[2]) {\n  return %x\n}", "line 1: unknown dtype 'q7'"),
    ("graph @g(%x: f32[2]) {\n  %y: f32[2] = relu(%x) {bogus=1}\n  return %y\n}", "unknown attribute"),
    ("graph @g(%x: f32[2]) {\n  %x: f32[2] = relu(%x)\n  return %x\n}", "defined twice"),
    ("graph @g(%x: f32[2]) {\n  %y: f32[2] = relu(%x) $\n  return %y\n}", "line 2: unexpected text"),
    ("graph @g(%x: f32[2]) {\n}", "no 'return'"),
])
def test_parser_names_the_problem_and_line(text, message):
    with pytest.raises(ParseError, match=message.replace("(", r"\(").replace("$", r"\$")):
        parse_graph(text)


def test_json_rejects_other_format_versions():
    data = serialize.to_dict(_odd_attrs_graph())
    data["format"] = 99
    with pytest.raises(ValueError, match="format 99"):
        serialize.from_dict(data)
