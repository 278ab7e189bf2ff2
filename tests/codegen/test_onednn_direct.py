"""Convolutions on oneDNN's own library (codegen/onednn_direct.py) against torch's."""
from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

from opweave import Options
from opweave.codegen import anchor_group, choice, library, lower, onednn_direct
from opweave.ir import Graph, TensorType
from opweave.pipeline import compile_graph
from opweave.runtime import Executor

# the package (onednn-cpu-gomp) exists for x86-64 Linux only; there it must work
pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64",
                                reason="oneDNN's pip package is for x86-64 Linux")
F32 = torch.float32


def _reference(x, w, b, stride, padding, dilation, groups, unary, residual):
    y = F.conv2d(x, w, b, stride, padding, dilation, groups)
    if residual is not None:
        y = y + residual
    if unary == "relu":
        return y.relu()
    if unary == RELU6:
        return y.clamp(0.0, 6.0)
    if isinstance(unary, tuple):
        return F.gelu(y, approximate=unary[1])
    return y


# N, C, H, W, O, K, stride, padding, dilation, groups
CONV_GEOMETRIES = [
    (1, 16, 9, 9, 8, 3, 1, 1, 1, 1),
    (2, 8, 7, 7, 12, 1, 2, 0, 1, 1),
    (1, 8, 10, 10, 8, 3, 1, 2, 2, 2),
    (1, 3, 15, 15, 16, 7, 2, 3, 1, 1),
]
RELU6 = ("clamp", 0.0, 6.0)
CONV_UNARIES = [None, "relu", ("gelu", "tanh"), RELU6]
CONV_BINARIES = [onednn_direct.NO_BINARY, onednn_direct.SUM_IN_PLACE, onednn_direct.ADD]


@pytest.mark.parametrize("geometry", CONV_GEOMETRIES)
@pytest.mark.parametrize("unary", CONV_UNARIES)
@pytest.mark.parametrize("binary", CONV_BINARIES)
def test_matches_torch_conv2d(geometry, unary, binary):
    n, c, h, w, o, k, s, p, d, g = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(n, c, h, w), torch.randn(o, c // g, k, k), torch.randn(o)
    conv = onednn_direct.DirectConv((n, c, h, w, o, k, k, g, s, s, p, p, d, d), weight, bias,
                                    unary, binary)
    residual = None
    if binary != onednn_direct.NO_BINARY:
        residual = torch.randn(conv.out_shape).contiguous(memory_format=torch.channels_last)
    want = _reference(x, weight, bias, s, p, d, g, unary, residual)
    given = None if residual is None else residual.clone()
    try:
        got = conv(x) if given is None else conv(x, given)
    except onednn_direct.ReferenceOnly as err:  # (AVX2: a grouped, dilated one with an add)
        pytest.skip(f"torch's form runs instead here: {err}")
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if binary == onednn_direct.SUM_IN_PLACE:
        assert got.data_ptr() == given.data_ptr()      # added into the residual itself
    elif given is not None:
        torch.testing.assert_close(given, residual, atol=0, rtol=0)  # left untouched


@pytest.mark.parametrize("geometry", [(7, 24, 40), (1, 16, 8), (200, 64, 96)])
@pytest.mark.parametrize("unary", [None, "tanh", ("gelu", "none"), RELU6])
@pytest.mark.parametrize("binary", [onednn_direct.NO_BINARY, onednn_direct.ADD])
def test_linear_matches_torch(geometry, unary, binary):
    m, k, n = geometry
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    product = onednn_direct.DirectLinear(geometry, weight, bias, unary, binary)
    residual = torch.randn(m, n) if binary == onednn_direct.ADD else None
    want = x @ weight + bias
    if residual is not None:
        want = want + residual
    if unary == "tanh":
        want = want.tanh()
    elif unary == RELU6:
        want = want.clamp(0.0, 6.0)
    elif unary is not None:
        want = F.gelu(want)
    got = product(x) if residual is None else product(x, residual.clone())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_in_place_sum_into_a_product_is_refused():
    product = onednn_direct.DirectLinear((2, 3, 4), torch.randn(3, 4), None, None,
                                         onednn_direct.SUM_IN_PLACE)
    with pytest.raises(RuntimeError, match="no in-place sum"):
        product(torch.randn(2, 3))


def test_a_wrong_input_is_refused_before_oneDNN_reads_it():
    conv = onednn_direct.DirectConv((1, 4, 5, 5, 4, 1, 1, 1, 1, 1, 0, 0, 1, 1),
                                    torch.randn(4, 4, 1, 1), None)
    with pytest.raises(ValueError, match=r"conv built for \(1, 4, 5, 5\) float32"):
        conv(torch.randn(1, 4, 6, 6))
    with pytest.raises(ValueError, match="float64"):
        conv(torch.randn(1, 4, 5, 5, dtype=torch.float64))


def test_an_impossible_convolution_is_refused_with_oneDNNs_reason():
    conv = onednn_direct.DirectConv((1, 6, 5, 5, 4, 1, 1, 4, 1, 1, 0, 0, 1, 1),
                                    torch.randn(4, 1, 1, 1), None)    # 6 channels, 4 groups
    with pytest.raises(RuntimeError, match="refused the conv .*inconsistent convolution geometry"):
        conv(torch.randn(1, 6, 5, 5))


def test_an_unbuildable_library_leaves_torchs_forms_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(onednn_direct, "_library", None)
    monkeypatch.setattr(onednn_direct, "_problem", None)
    monkeypatch.setattr(onednn_direct, "_prefix", lambda: tmp_path)
    with pytest.warns(onednn_direct.OneDNNWarning, match="is missing"):
        assert onednn_direct.library() is None
    assert onednn_direct.library() is None                 # said once
    assert "onednn-cpu-gomp" in onednn_direct.unavailable()
    g = _block()
    forms = library.forms(g, *_anchor_and_epilogue(g))
    assert "onednn" in forms and "onednn-direct" not in forms


def _block() -> Graph:
    """conv+relu, then conv + residual add + relu: ResNet's groups."""
    g = Graph("block")
    x = g.add_input("x", TensorType((1, 16, 9, 9), F32))

    def conv(v, name):
        w = g.add_constant(f"{name}_w", torch.randn(16, 16, 3, 3) / 12)
        b = g.add_constant(f"{name}_b", torch.randn(16))
        return g.add1("conv", [v, w, b], {"stride": [1, 1], "padding": [1, 1],
                                          "dilation": [1, 1], "groups": 1})
    h = g.add1("relu", [conv(x, "c1")])
    g.outputs = [g.add1("relu", [g.add1("add", [conv(h, "c2"), x])])]
    return g


def _anchor_and_epilogue(g: Graph):
    from opweave.partition.legality import Epilogue
    anchor = next(n for n in g.nodes if n.op == "conv")
    relu = next(n for n in g.nodes if n.op == "relu")
    return anchor, Epilogue(unary=relu, chain=(relu,))


def test_the_lowering_runs_resnets_groups_on_it_and_the_native_plan_replays_them(monkeypatch):
    monkeypatch.setattr(library, "_winograd_fits", lambda *_: False)  # the direct form itself
    g = _block()
    lowered = lower(g, "ilp", measure=False)
    direct = [s for s in lowered.steps if s.kind == "library"]
    assert [s.name for s in direct] == ["conv+relu", "conv+add+relu"]
    x = torch.randn(1, 16, 9, 9)
    want = Executor(g)(x)
    torch.testing.assert_close(Executor(g, steps=lowered.steps)(x)[0], want[0],
                               atol=1e-4, rtol=1e-4)
    assert_replayed_natively(_block(), (1, 16, 9, 9))


def assert_replayed_natively(g: Graph, shape) -> None:
    """`g` compiled unmeasured: its native plan calls both convolutions as raw functions
    and agrees with the graph's ops."""
    compiled = compile_graph(g, Options(deterministic=True, measure=False, native="wait",
                                        tuning_db=None))
    executor = compiled.executor
    for _ in range(3):
        executor(torch.randn(shape))
    assert executor.native.plan is not None, executor.native.describe()
    assert executor.native.counts[1] >= 2      # both convolutions are raw calls in the plan
    x = torch.randn(shape)
    torch.testing.assert_close(executor(x)[0], Executor(compiled.graph)(x)[0],
                               atol=1e-4, rtol=1e-4)


def test_the_direct_form_is_kept_unless_another_is_clearly_faster():
    assert choice._preferring_direct({"onednn": [1.0], "onednn-direct": [1.02]}) == \
        "onednn-direct"
    assert choice._preferring_direct({"onednn": [1.0], "onednn-direct": [1.05]}) == "onednn"
    assert choice._preferring_direct({"onednn": [1.0], "reference": [0.9]}) == "reference"


def test_a_bf16_form_is_kept_unless_a_float32_form_is_faster():
    pick = choice._preferring_bf16
    # among bf16 forms, the direct one unless another is clearly faster
    assert pick({"onednn-bf16": [1.0], "onednn-direct-bf16": [1.02], "onednn": [1.5]}) == \
        "onednn-direct-bf16"
    assert pick({"onednn-bf16": [1.0], "onednn-direct-bf16": [1.05]}) == "onednn-bf16"
    # float32 faster: kept, with its own preference for the direct form
    near = {"onednn-direct-bf16": [1.0], "onednn-direct": [0.95], "reference": [0.94]}
    assert pick(near) == "onednn-direct"
    # unless the operand may come in bf16 and float32 is faster only within the margin
    assert pick(near, handed=True) == "onednn-direct-bf16"
    clear = {"onednn-direct-bf16": [1.0], "onednn": [0.80], "onednn-direct": [0.82]}
    assert pick(clear, handed=True) == "onednn-direct"
    assert pick({"onednn-bf16": [1.0], "reference": [0.5]}, handed=True) == "reference"
    # float32 forms alone (bf16 not offered): as `_preferring_direct`
    assert pick({"onednn": [1.0], "onednn-direct": [1.02]}) == "onednn-direct"


def test_a_3d_convolution_is_left_to_torchs_forms():
    g = Graph("c3d")
    x = g.add_input("x", TensorType((1, 4, 5, 5, 5), F32))
    w = g.add_constant("w", torch.randn(4, 4, 3, 3, 3))
    conv = g.add1("conv", [x, w], {"stride": [1, 1, 1], "padding": [1, 1, 1],
                                   "dilation": [1, 1, 1], "groups": 1})
    g.outputs = [conv]
    from opweave.partition.legality import Epilogue
    assert not anchor_group.direct_fits(conv.producer, Epilogue())
    assert "onednn-direct" not in library.forms(g, conv.producer, Epilogue())


def test_another_thread_count_gets_a_primitive_of_its_own():
    torch.manual_seed(0)
    x, weight = torch.randn(1, 32, 14, 14), torch.randn(64, 32, 3, 3)
    conv = onednn_direct.DirectConv((1, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1), weight,
                                    None, "relu")
    want = F.conv2d(x, weight, None, 1, 1).relu()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.testing.assert_close(conv(x), want, atol=1e-4, rtol=1e-4)   # made for 1
        torch.set_num_threads(2)
        torch.testing.assert_close(conv(x), want, atol=1e-4, rtol=1e-4)
        assert conv.variants() == 1
        torch.testing.assert_close(conv(x), want, atol=1e-4, rtol=1e-4)
        assert conv.variants() == 1                                         # made once
    finally:
        torch.set_num_threads(threads)


def test_a_graph_compiled_for_many_sizes_keeps_its_own_records():
    """There the form is not offered; its choice among fewer forms must not overwrite
    the record a one-size compile made at the same shapes."""
    from opweave import shared_constants
    g = _block()
    anchor, ep = _anchor_and_epilogue(g)
    alone = library.signature(g, anchor, ep)
    with shared_constants.sharing(1):
        shared = library.signature(g, anchor, ep)
        assert "onednn-direct" not in library.forms(g, anchor, ep)
    # (where Winograd's form is withheld, alone says so and shared lets the direct form's
    # absence say it: `library.signature`)
    alone = tuple(part for part in alone if part != ("without", "onednn-winograd"))
    assert shared == alone + (("without", "onednn-direct"),)


def test_an_activation_after_a_reshape_is_costed_without_an_illegal_group():
    """matmul + bias + reshape + gelu (BERT's feed-forward as exported): the group without
    its activation would end in a reshape, which is no group; measuring must not build it."""
    from ..partition.graphs import linear
    g = Graph("ffn")
    x = g.add_input("x", TensorType((1, 6, 24), F32))
    rows = g.add1("reshape", [x], {"shape": [6, 24]})
    y = g.add1("reshape", [linear(g, rows, 24, 40, "fc")], {"shape": [1, 6, 40]})
    g.outputs = [g.add1("gelu", [y], {"approximate": "none"})]
    lowered = lower(g, "ilp", measure=True)
    x = torch.randn(1, 6, 24)
    torch.testing.assert_close(Executor(g, steps=lowered.steps)(x)[0], Executor(g)(x)[0],
                               atol=1e-4, rtol=1e-4)


def test_a_reference_only_primitive_gives_way_to_torchs_form(monkeypatch):
    """Where oneDNN would run its reference kernel (100-1000x slower), the group runs
    torch's form, said once; the results are the same."""
    real = onednn_direct.library()

    class ReferenceOnlyHere:
        def __getattr__(self, name):
            return getattr(real, name)

        def ow_onednn_impl(self, handle):
            return b"ref:any"

    monkeypatch.setattr(onednn_direct, "_library", ReferenceOnlyHere())
    monkeypatch.setattr(library, "_winograd_fits", lambda *_: False)  # the direct form itself
    g = _block()
    lowered = lower(g, "ilp", measure=False)
    x = torch.randn(1, 16, 9, 9)
    with pytest.warns(onednn_direct.OneDNNWarning, match="only its reference conv"):
        got = Executor(g, steps=lowered.steps)(x)[0]
    torch.testing.assert_close(got, Executor(g)(x)[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(Executor(g, steps=lowered.steps)(x)[0], got)


@pytest.mark.parametrize("bounds, fused", [((0.0, 6.0), True), ((-1.0, 2.5), True),
                                           ((0.0, None), False)])
def test_a_clamp_after_a_convolution_is_its_post_op_in_every_form(bounds, fused):
    """MobileNet's depthwise convolution + ReLU6: torch's forms take a clamp with two
    bounds as "hardtanh", the direct form ReLU6 as oneDNN's clip; a clamp with one bound
    is not an epilogue."""
    from opweave.codegen.render import FUSIBLE
    from opweave.partition.classify import constant_of
    from opweave.partition.context import Context
    from opweave.partition.legality import Epilogue, anchor_epilogue
    torch.manual_seed(0)
    g = Graph("dw")
    x = g.add_input("x", TensorType((1, 24, 10, 10), F32))
    conv = g.add1("conv", [x, g.add_constant("w", torch.randn(24, 1, 3, 3)),
                           g.add_constant("b", torch.randn(24))],
                  {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 24})
    clamp = g.add1("clamp", [conv], {"min": bounds[0], "max": bounds[1]})
    g.outputs = [clamp]
    anchor, node = conv.producer, clamp.producer
    ep = anchor_epilogue(Context(g, FUSIBLE), {anchor, node})
    assert isinstance(ep, Epilogue) == fused, ep
    if not fused:
        return
    forms = library.forms(g, anchor, ep)
    assert ("onednn-direct" in forms) == (bounds == (0.0, 6.0) and onednn_direct.library() is not None)
    data = (torch.randn(1, 24, 10, 10) * 4).contiguous(memory_format=torch.channels_last)
    want = torch.clamp(F.conv2d(data, constant_of(g, anchor.inputs[1]),
                                constant_of(g, anchor.inputs[2]), padding=1, groups=24), *bounds)
    for name, form in forms.items():
        (got,) = form(data)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)
