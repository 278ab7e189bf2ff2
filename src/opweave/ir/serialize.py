"""The JSON form of a graph, for tools and for storing graphs beside their weights.

Constant data is not embedded: `save`/`load` write the JSON and the tensors side by side
(the tensors with `torch.save`, weights only), each file replaced atomically.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from . import dtypes
from ..files import atomic_write, atomic_write_bytes
from .graph import Graph, Value
from . import symbols
from .types import TensorType

FORMAT_VERSION = 1


def _attr_to_json(value):
    if symbols.is_symbolic(value):
        return {"dim": symbols.to_text(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": dtypes.name_of(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        return [_attr_to_json(v) for v in value]
    return value


def _attr_from_json(value):
    if isinstance(value, dict):
        if "dtype" in value:
            return dtypes.to_torch(value["dtype"])
        if "float" in value:
            return float(value["float"])
        if "dim" in value:
            return symbols.parse(value["dim"])
        raise ValueError(f"bad attribute value {value!r}")
    if isinstance(value, list):
        return [_attr_from_json(v) for v in value]
    return value


def _type_json(t: TensorType) -> dict:
    shape = [d if isinstance(d, int) else symbols.to_text(d) for d in t.shape]
    return {"shape": shape, "dtype": dtypes.name_of(t.dtype)}


def _type_from(d: dict) -> TensorType:
    shape = tuple(symbols.parse(x) if isinstance(x, str) else x for x in d["shape"])
    return TensorType(shape, dtypes.to_torch(d["dtype"]))


def to_dict(graph: Graph) -> dict:
    return {
        "format": FORMAT_VERSION,
        "name": graph.name,
        "inputs": [{"name": v.name, **_type_json(v.type)} for v in graph.inputs],
        **({"symbols": list(graph.symbols)} if graph.symbols else {}),
        "nodes": [{
            "op": n.op,
            "inputs": [v.name for v in n.inputs],
            "outputs": [{"name": v.name, **_type_json(v.type)} for v in n.outputs],
            "attrs": {k: _attr_to_json(v) for k, v in n.attrs.items()},
            **({"source": n.source} if n.source else {}),
        } for n in graph.nodes],
        "outputs": [v.name for v in graph.outputs],
    }


def from_dict(data: dict, constants: dict[str, torch.Tensor] | None = None) -> Graph:
    """Rebuild a graph; types are taken as stored (run `verify` to check them)."""
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"graph JSON has format {data.get('format')!r}, expected {FORMAT_VERSION}")
    graph = Graph(data["name"])
    values: dict[str, Value] = {}

    def lookup(name: str, where: str) -> Value:
        if name not in values:
            raise ValueError(f"{where}: value %{name} is not defined before use")
        return values[name]

    for item in data["inputs"]:
        values[item["name"]] = graph.add_input(item["name"], _type_from(item))
    graph.symbols = list(data.get("symbols", []))
    for i, item in enumerate(data["nodes"]):
        where = f"node {i} ({item.get('op')})"
        outs = graph.add(item["op"], [lookup(n, where) for n in item["inputs"]],
                         {k: _attr_from_json(v) for k, v in item["attrs"].items()},
                         types=[_type_from(o) for o in item["outputs"]],
                         source=item.get("source", ""))
        for spec, value in zip(item["outputs"], outs):
            graph.rename(value, spec["name"])
            values[value.name] = value
    graph.outputs = [lookup(n, "graph outputs") for n in data["outputs"]]
    graph.constants.update(constants or {})
    return graph


def to_json(graph: Graph) -> str:
    return json.dumps(to_dict(graph), indent=1)


def from_json(text: str, constants: dict[str, torch.Tensor] | None = None) -> Graph:
    return from_dict(json.loads(text), constants)


def save(graph: Graph, path: str | os.PathLike) -> None:
    """Write `path` (JSON) and `path` + '.pt' (constant tensors), each atomically."""
    path = Path(path)
    atomic_write(path.with_name(path.name + ".pt"), lambda tmp: torch.save(graph.constants, tmp))
    atomic_write_bytes(path, to_json(graph).encode())


def load(path: str | os.PathLike) -> Graph:
    path = Path(path)
    constants = torch.load(path.with_name(path.name + ".pt"), weights_only=True)
    return from_json(path.read_text(), constants)
