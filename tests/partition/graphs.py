"""Small graphs shaped like the blocks of the benchmark models, for fusion tests."""
from __future__ import annotations

import torch

from opweave.ir import Graph, TensorType

F32 = torch.float32


def linear(g: Graph, x, n_in: int, n_out: int, name: str, bias: bool = True):
    """matmul by a constant weight stored transposed (as the layout pass leaves it) + bias."""
    w = g.add_constant(f"{name}_w", torch.randn(n_out, n_in) / n_in ** 0.5)
    y = g.add1("matmul", [x, g.add1("permute", [w], {"dims": [1, 0]})])
    if bias:
        y = g.add1("add", [y, g.add_constant(f"{name}_b", torch.randn(n_out))])
    return y


def mlp_block(rows=16, width=32, hidden=64, act="gelu") -> Graph:
    """x -> linear+bias -> act -> linear+bias -> reshape -> +x -> layer norm (BERT's FFN)."""
    g = Graph("mlp")
    x = g.add_input("x", TensorType((1, rows, width), F32))
    flat = g.add1("reshape", [x], {"shape": [rows, width]})
    h = linear(g, flat, width, hidden, "fc1")
    h = g.add1(act, [h])
    y = linear(g, h, hidden, width, "fc2")
    y = g.add1("reshape", [y], {"shape": [1, rows, width]})
    y = g.add1("add", [y, x])
    w = g.add_constant("ln_w", torch.rand(width) + 0.5)
    b = g.add_constant("ln_b", torch.randn(width))
    g.outputs = [g.add("layer_norm", [y, w, b], {"normalized_shape": [width], "eps": 1e-5})[0]]
    return g


def stacked_mlp(layers=3, **kw) -> Graph:
    """Several identical blocks in a row (to exercise the structural cache)."""
    g = Graph("stack")
    rows, width = kw.get("rows", 16), kw.get("width", 32)
    x = g.add_input("x", TensorType((1, rows, width), F32))
    v = x
    for i in range(layers):
        flat = g.add1("reshape", [v], {"shape": [rows, width]})
        h = g.add1("gelu", [linear(g, flat, width, 2 * width, f"a{i}")])
        y = g.add1("reshape", [linear(g, h, 2 * width, width, f"b{i}")], {"shape": [1, rows, width]})
        y = g.add1("add", [y, v])
        w = g.add_constant(f"ln{i}_w", torch.rand(width) + 0.5)
        b = g.add_constant(f"ln{i}_b", torch.randn(width))
        v = g.add("layer_norm", [y, w, b], {"normalized_shape": [width], "eps": 1e-5})[0]
    g.outputs = [v]
    return g


def attention_scores(heads=2, seq=8) -> Graph:
    """(scores * scale + mask) -> softmax: a prologue fused into a row reduction."""
    g = Graph("scores")
    s = g.add_input("s", TensorType((1, heads, seq, seq), F32))
    mask = g.add_input("mask", TensorType((1, 1, 1, seq), F32))
    scaled = g.add1("mul", [s, g.add_constant("scale", torch.tensor(0.125))])
    g.outputs = [g.add1("softmax", [g.add1("add", [scaled, mask])], {"dim": 3})]
    return g
