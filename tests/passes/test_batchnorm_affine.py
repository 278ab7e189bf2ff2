"""Inference batch norm that no convolution absorbed becomes a per-channel scale and shift."""
from __future__ import annotations

import warnings

import torch

import opweave
from opweave.ir import Graph, TensorType
from opweave.passes.batchnorm_affine import batch_norm_as_affine
from opweave.pipeline import PassWarning
from opweave.runtime import Executor

F32 = torch.float32


def _stats(g: Graph, channels: int, dtype=F32) -> list:
    torch.manual_seed(0)
    return [g.add_constant(name, data.to(dtype)) for name, data in
            (("gamma", torch.rand(channels) + 0.5), ("beta", torch.randn(channels)),
             ("mean", torch.randn(channels)), ("var", torch.rand(channels) + 0.5))]


def test_constant_statistics_become_a_scale_and_shift_with_the_same_values():
    g = Graph("bn")
    x = g.add_input("x", TensorType((2, 6, 4, 5), F32))
    g.outputs = [g.add1("relu", [g.add1("batch_norm", [x, *_stats(g, 6)], {"eps": 1e-3})])]
    data = torch.randn(2, 6, 4, 5)
    (want,) = Executor(g)(data)
    assert batch_norm_as_affine(g) == 1
    assert g.op_counts() == {"constant": 2, "mul": 1, "add": 1, "relu": 1}
    (got,) = Executor(g)(data)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_half_precision_norm_stays_one_op():
    """torch rounds a bf16 batch norm once; a bf16 product and shift would round twice
    before they nearly cancel (with a running mean of 100 and outputs near 2: an error of
    1.9 against 0.03)."""
    for dtype in (torch.bfloat16, torch.float16):
        g = Graph("bn")
        x = g.add_input("x", TensorType((2, 6, 4, 5), dtype))
        g.outputs = [g.add1("batch_norm", [x, *_stats(g, 6, dtype)])]
        assert batch_norm_as_affine(g) == 0
        assert g.op_counts()["batch_norm"] == 1


def test_statistics_known_only_at_run_time_stay_a_batch_norm():
    g = Graph("bn")
    x = g.add_input("x", TensorType((2, 6, 4, 5), F32))
    gamma = g.add_input("gamma", TensorType((6,), F32))
    g.outputs = [g.add1("batch_norm", [x, gamma, *_stats(g, 6)[1:]])]
    assert batch_norm_as_affine(g) == 0
    assert g.op_counts()["batch_norm"] == 1


def test_densenet_style_norm_of_a_concatenation_fuses_with_its_relu():
    """DenseNet's pre-activation: batch norm and ReLU over a concatenation, then a 1x1
    convolution. The norm cannot fold into the convolution before the concatenation; as
    scale and shift it joins the ReLU's kernel, and the result is eager's."""
    torch.manual_seed(0)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.norm = torch.nn.BatchNorm2d(16)
            self.conv = torch.nn.Conv2d(16, 4, 1)

        def forward(self, x):
            y = self.stem(x)
            return self.conv(torch.relu(self.norm(torch.cat([y, y * 2], 1))))

    layer, x = Layer().eval(), torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        layer.norm.running_mean.normal_()
        layer.norm.running_var.uniform_(0.5, 2.0)
        want = layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassWarning)  # the pass must not fail and be skipped
        compiled = opweave.compile(layer, (x,))
    torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)
    counts = compiled.graphs[0].op_counts()
    assert "batch_norm" not in counts and counts["relu"] == 1, counts
