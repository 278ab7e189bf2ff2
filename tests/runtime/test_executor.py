"""The executor and its memory plan: liveness, arena packing, outputs, input checks."""
from __future__ import annotations

import pytest
import torch

from opweave.ir import Graph, TensorType
from opweave.runtime import Executor, InputError, native, plan_memory
from opweave.tools.memory_stats import peak_allocated_bytes

from ..conftest import MODEL_NAMES, compiled_small, small_model


def _chain(n=6, size=256):
    g = Graph("chain")
    x = g.add_input("x", TensorType((size, size), torch.float32))
    v = x
    for i in range(n):
        v = g.add1("exp" if i % 2 else "neg", [v])
    g.outputs = [g.add1("sum", [v], {"dims": [0, 1]})]
    return g


def test_liveness_frees_each_value_after_its_last_use():
    g = _chain()
    plan = plan_memory(g)
    for i, node in enumerate(g.nodes[:-1]):
        assert plan.frees[i + 1] == [node.outputs[0]]  # read by the next node only


def test_arena_reuses_bytes_of_dead_values():
    g = _chain(n=6)
    plan = plan_memory(g)
    one = 256 * 256 * 4
    assert len(plan.offsets) == 6
    assert plan.arena_bytes == 2 * one  # a chain needs two buffers, ping-pong
    x = torch.randn(256, 256)
    ref = x
    for i in range(6):
        ref = ref.exp() if i % 2 else ref.neg()
    for use_arena in (False, True):
        torch.testing.assert_close(Executor(g, use_arena=use_arena)(x)[0], ref.sum())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_arena_never_overlaps_live_values(name):
    (graph,) = compiled_small(name).graphs
    plan = plan_memory(graph)
    index = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    placed = [(plan.offsets[v], plan.offsets[v] + v.type.nbytes, index[v], v) for v in plan.offsets]
    # a value's lifetime ends at the last use of it or of any view of it
    ends = {}
    for v in plan.offsets:
        ends[v] = max([plan.last_use[u] for u in _aliases(graph, v)] + [index[v]])
    for a0, a1, born_a, va in placed:
        for b0, b1, born_b, vb in placed:
            if va is vb or a1 <= b0 or b1 <= a0:
                continue
            assert ends[va] < born_b or ends[vb] < born_a, f"{va} and {vb} overlap in time and bytes"
    assert not set(plan.offsets) & set(graph.outputs)


def _aliases(graph, value):
    out, frontier = {value}, [value]
    while frontier:
        v = frontier.pop()
        for n in graph.nodes:
            if n.opdef.is_view and n.inputs and n.inputs[0] is v:
                out.add(n.outputs[0])
                frontier.append(n.outputs[0])
    return out


@pytest.mark.parametrize("use_arena", [False, True])
def test_outputs_stay_valid_across_calls(use_arena):
    g = _chain(n=3, size=16)
    g.outputs.insert(0, g.nodes[1].outputs[0])  # an intermediate that is also an output
    ex = Executor(g, use_arena=use_arena)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    first = [t.clone() for t in ex(a)]
    kept = ex(a)
    ex(b)
    for f, k in zip(first, kept):
        torch.testing.assert_close(f, k)


def test_inputs_returned_as_outputs_are_copies():
    g = Graph("id")
    x = g.add_input("x", TensorType((3,), torch.float32))
    g.outputs = [x]
    t = torch.randn(3)
    (out,) = Executor(g)(t)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()


def test_input_mismatch_is_a_clear_error():
    ex = Executor(_chain(size=4))
    with pytest.raises(InputError, match=r"input 0 \(%x\) has shape \[4, 5\] and dtype torch.float32, expected f32\[4,4\]"):
        ex(torch.randn(4, 5))
    with pytest.raises(InputError, match=r"takes 1 inputs, got 2"):
        ex(torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(InputError, match=r"input 0 \(%x\) is a meta tensor, expected a cpu strided"):
        ex(torch.randn(4, 4, device="meta"))
    with pytest.raises(InputError, match=r"input 0 \(%x\) is a cpu sparse_coo tensor"):
        ex(torch.randn(4, 4).to_sparse())


@pytest.mark.parametrize("name", ["bert-base", "resnet50", "xmlcnn"])
def test_peak_memory_does_not_exceed_eager(name):
    bench, compiled = small_model(name), compiled_small(name)
    with torch.no_grad():
        for _ in range(native.RECORD_AT_CALL + 2):  # warm: past recording and checking
            compiled(*bench.inputs)
        eager = peak_allocated_bytes(lambda: bench.module(*bench.inputs))
        ours = peak_allocated_bytes(lambda: compiled(*bench.inputs))
    assert eager > 0
    assert ours <= eager, f"opweave peak {ours} B > eager {eager} B"


@pytest.mark.parametrize("lowered", [False, True])
def test_ops_reading_no_tensor_run_where_the_graph_runs_and_are_copied_out(lowered):
    """On another device (meta stands in for a GPU) `full` is made once there and reused;
    the caller gets its own copy each call, whether steps are lowered or per node."""
    from opweave.codegen import lower

    g = Graph("fill")
    x = g.add_input("x", TensorType((3,), torch.float32))
    filled = g.add1("full", [], {"shape": [3], "value": 2.0, "dtype": torch.float32})
    g.outputs = [g.add1("add", [x, filled]), filled]
    steps = lower(g, "off").steps if lowered else None
    run = Executor(g, steps=steps, device="meta")
    first = run(torch.empty(3, device="meta"))
    second = run(torch.empty(3, device="meta"))
    assert all(t.device.type == "meta" for t in first + second)
    assert first[1] is not second[1]


def test_constants_on_another_device_are_copied_once_and_shared():
    """Executors of one graph (a dynamic graph's plans, a placement's groups) share one
    copy of each constant on the device; a constant copied from there is not copied back."""
    from opweave.runtime.executor import copied_from, on_device

    g = Graph("w")
    x = g.add_input("x", TensorType((2,), torch.float32))
    w = torch.randn(2)
    g.outputs = [g.add1("add", [x, g.add_constant("w", w)])]
    meta = torch.device("meta")
    first, second = Executor(g, device="meta"), Executor(g, device="meta")
    assert first._base[1] is second._base[1] and first._base[1].device == meta
    origin = torch.empty(2, device="meta")
    host = torch.zeros(2)
    copied_from(host, origin)
    assert on_device(host, meta) is origin
