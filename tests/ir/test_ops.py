"""Every op in the registry against eager PyTorch, on generated shapes and dtypes.

For each case: the op's shape and dtype rules must give exactly the type eager computes,
and a one-node graph run by the executor (arena path included) must match eager.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from opweave.ir import Graph, TensorType, registry, verify
from opweave.runtime import Executor

from .op_cases import CASES


def test_every_registered_op_has_cases():
    assert set(registry.all_ops()) == set(CASES)


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _one_node_graph(op, case):
    graph = Graph(op)
    inputs = [graph.add_input(f"x{i}", TensorType.of(t)) for i, t in enumerate(case.inputs)]
    outs = graph.add(op, inputs, case.attrs)
    graph.outputs = outs
    graph.constants.update(case.constants or {})
    return verify(graph)


@pytest.mark.parametrize("op", sorted(CASES))
def test_op_matches_eager(op):
    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(case=CASES[op])
    def check(case):
        expected = _as_list(case.eager(*case.inputs))
        graph = _one_node_graph(op, case)
        assert [v.type for v in graph.outputs] == [TensorType.of(t) for t in expected]
        tolerance = case.tolerance or {"rtol": 1e-5, "atol": 1e-6}
        for use_arena in (True, False):
            got = Executor(graph, use_arena=use_arena)(*case.inputs)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, equal_nan=True, **tolerance)
        cost = graph.cost()
        assert cost.flops >= 0 and cost.bytes >= 0

    check()


def test_dropout_mask_and_scaling():
    x = torch.randn(1000, dtype=torch.float64)
    graph = Graph("dropout")
    out, mask = graph.add("dropout", [graph.add_input("x", TensorType.of(x))], {"p": 0.25})
    graph.outputs = [out, mask]
    y, m = Executor(verify(graph))(x)
    assert 0.6 < m.double().mean() < 0.9
    torch.testing.assert_close(y, x * m / 0.75)


def test_rules_reject_bad_shapes_with_clear_message():
    graph = Graph("bad")
    a = graph.add_input("a", TensorType((2, 3), torch.float32))
    b = graph.add_input("b", TensorType((4, 5), torch.float32))
    with pytest.raises(registry.ShapeError, match=r"inner dims differ"):
        graph.add("matmul", [a, b])
    with pytest.raises(registry.ShapeError, match=r"do not broadcast"):
        graph.add("add", [a, b])
    with pytest.raises(ValueError, match=r"missing attribute 'dim'"):
        graph.add("softmax", [a], {})


@pytest.mark.parametrize("attrs, message", [
    ({"size": [8, 12], "scales_h": -2.0}, r"scales_h=-2.0 is not a finite positive factor"),
    ({"size": [8, 12], "scales_w": 1.0}, r"scales_w=1.0 gives 6 rows from 6, not 12"),
    ({"size": [8, 0]}, r"must be two sizes >= 1"),
])
def test_upsampling_rule_refuses_sizes_its_factors_do_not_give(attrs, message):
    """Found by `opweave fuzz`: torch's kernel reads past the input (an IndexError, or
    garbage) where the output size is not floor(in * factor)."""
    graph = Graph("bad")
    x = graph.add_input("x", TensorType((1, 2, 4, 6), torch.float32))
    with pytest.raises(registry.ShapeError, match=message):
        graph.add("upsample_bilinear2d", [x], attrs)


@pytest.mark.parametrize("attrs, message", [
    ({"dilation": [0, 1]}, r"dilation must be >= 1"),
    ({"stride": [1, 0]}, r"stride must be >= 1"),
    ({"padding": [-1, 0]}, r"padding must be >= 0"),
    ({"groups": 0}, r"groups must be >= 1"),
])
def test_conv_rule_rejects_what_torch_refuses(attrs, message):
    """Found by `opweave fuzz`: with an empty input torch skipped its own checks, and the
    rule gave a shape for dilation 0 that torch did not compute."""
    graph = Graph("conv")
    x = graph.add_input("x", TensorType((1, 2, 5, 5), torch.float32))
    w = graph.add_input("w", TensorType((2, 2, 2, 2), torch.float32))
    full = {"stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, **attrs}
    with pytest.raises(registry.ShapeError, match=message):
        graph.add("conv", [x, w], full)


def test_attention_of_transposed_operands_and_a_scale_of_zero_or_below_matches_the_math_form():
    """Found by `opweave fuzz` and the op cases: torch's fused kernel, called directly,
    reads rows as contiguous (a permuted query gave garbage), and with a causal or -inf
    mask and a negative scale, or one that is 0 in float32, it gave NaN (it masks, then
    scales). The backward too."""
    from opweave.ir.ops.linalg import (_attention_backward, _attention_backward_math,
                                       _attention_lse, _attention_math)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 4, 5, generator=gen).permute(2, 3, 0, 1)  # [4, 5, 3, 4], rows strided
    k, v = torch.randn(4, 5, 3, 4, generator=gen), torch.randn(4, 5, 3, 4, generator=gen)
    grad = torch.randn(4, 5, 3, 4, generator=gen)
    assert q.stride(-1) != 1
    keep = torch.rand(3, 3, generator=gen) < 0.5
    keep[:, 0] = True
    additive = torch.zeros(3, 3).masked_fill(~keep, float("-inf"))
    for causal in (False, True):
        for mask in (None, keep):
            for scale in (-1.0, 0.5, 0.0, 1e-62, -1e-62):
                math_mask = None if mask is None else additive
                out, lse = _attention_lse(q, k, v, mask, scale=scale, causal=causal)
                torch.testing.assert_close(
                    (out, lse), _attention_math(q, k, v, math_mask, scale, causal))
                assert not out.isnan().any()
                torch.testing.assert_close(
                    _attention_backward(grad, q, k, v, out, lse, mask, scale=scale, causal=causal),
                    _attention_backward_math(grad, q, k, v, out, lse, math_mask, scale, causal))


@pytest.mark.parametrize("attrs, grad, message", [
    ({"dilation": [0]}, (5, 5, 3), r"dilation must be >= 1"),
    ({}, (5, 5, 4), r"grad f32\[5,5,4\] is not the shape conv gives"),
])
def test_conv_backward_rule_holds_the_forward_rules(attrs, grad, message):
    """Found by `opweave fuzz`: conv_backward checked nothing, so a graph with dilation 0
    passed the rules (eager's convolution_backward accepted it) and the compile failed."""
    graph = Graph("conv_backward")
    g = graph.add_input("g", TensorType(grad, torch.float32))
    x = graph.add_input("x", TensorType((5, 5, 3), torch.float32))
    w = graph.add_input("w", TensorType((5, 5, 3), torch.float32))
    full = {"stride": [1], "padding": [1], "dilation": [1], "groups": 1,
            "output_mask": [1, 1, 1], **attrs}
    with pytest.raises(registry.ShapeError, match=message):
        graph.add("conv_backward", [g, x, w], full)


@pytest.mark.parametrize("x, w, out", [((4, 0, 1), (4, 0, 1), (4, 0, 3)),
                                        ((0, 2, 5), (3, 2, 2), (0, 3, 6))])
def test_conv_of_an_empty_input_has_the_shape_torch_gives(x, w, out):
    """Found by `opweave fuzz`: torch gives an input without channels an output without
    channels; the rule said the weight's channel count."""
    graph = Graph("conv")
    xv = graph.add_input("x", TensorType(x, torch.float32))
    wv = graph.add_input("w", TensorType(w, torch.float32))
    y = graph.add1("conv", [xv, wv], {"stride": [1], "padding": [1], "dilation": [1]})
    assert y.type.shape == out == tuple(registry.get("conv").impl(
        torch.zeros(x), torch.zeros(w), stride=[1], padding=[1], dilation=[1], groups=1).shape)


@pytest.mark.parametrize("op", ["batch_norm", "batch_norm_train", "batch_norm_backward"])
def test_batch_norm_rules_reject_integer_operands(op):
    """Found by `opweave fuzz`: the rules took integer statistics."""
    graph = Graph("bn")
    x = graph.add_input("x", TensorType((3, 2, 5), torch.float32))
    stat = graph.add_input("s", TensorType((2,), torch.int64))
    inputs = [x, x, stat, stat, stat] if op == "batch_norm_backward" else [x] + [stat] * 4
    with pytest.raises(registry.ShapeError, match="floating-point operands"):
        graph.add(op, inputs)


def test_batch_norm_backward_rule_rejects_an_empty_input():
    """Found by `opweave fuzz`: torch's kernel dies of SIGFPE on one (any dtype), so the
    IR must not hold one for the executor to run."""
    graph = Graph("bn")
    x = graph.add_input("x", TensorType((0, 2, 5), torch.float32))
    stat = graph.add_input("s", TensorType((2,), torch.float32))
    with pytest.raises(registry.ShapeError, match="empty input"):
        graph.add("batch_norm_backward", [x, x, stat, stat, stat])


def test_arange_rule_rejects_a_fractional_step_with_an_integer_dtype():
    """Found by `opweave fuzz`: torch.export and Dynamo fail on it ("step must be
    nonzero") while eager computes [0, 0]."""
    graph = Graph("arange")
    with pytest.raises(registry.ShapeError, match="fractional bounds or step"):
        graph.add("arange", [], {"start": 0, "end": 1, "step": 0.5, "dtype": torch.int32})
    assert graph.add1("arange", [], {"end": 3.0, "step": 1.0, "dtype": torch.int64}).type.shape == (3,)
