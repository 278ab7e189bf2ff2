"""CPU/GPU placement on simulated devices (cost tables): overlap is chosen when two
branches can run side by side and transfers are cheap, and not when transfers dominate
or one device is much faster; grouping keeps chains whole and branches apart."""
from __future__ import annotations

import torch

from opweave.ir import Graph, TensorType
from opweave.schedule.placement import CostTable, group, place

F32 = torch.float32


def two_branches(n: int = 32) -> Graph:
    """x -> (x @ A -> relu) and (x @ B -> tanh) -> add."""
    g = Graph("branches")
    x = g.add_input("x", TensorType((n, n), F32))
    a = g.add1("relu", [g.add1("matmul", [x, g.add_constant("A", torch.randn(n, n))])])
    b = g.add1("tanh", [g.add1("matmul", [x, g.add_constant("B", torch.randn(n, n))])])
    g.outputs = [g.add1("add", [a, b])]
    return g


def test_groups_keep_chains_whole_and_branches_apart():
    g = two_branches()
    groups = group(g)
    assert [[n.op for n in s.nodes] for s in groups] == [["matmul", "relu"], ["matmul", "tanh"],
                                                          ["add"]]
    assert [s.inputs for s in groups[:2]] == [[g.inputs[0]], [g.inputs[0]]]
    assert groups[2].inputs == [groups[0].outputs[0], groups[1].outputs[0]]
    assert groups[2].returns == g.outputs


def test_groups_of_a_chain_are_one():
    g = Graph("chain")
    x = g.add_input("x", TensorType((4, 4), F32))
    g.outputs = [g.add1("exp", [g.add1("relu", [g.add1("neg", [x])])])]
    assert [len(s.nodes) for s in group(g)] == [3]


def _costs(branch_cpu, branch_gpu, join=1e-4, **link):
    return CostTable({"cpu": [branch_cpu, branch_cpu, join], "cuda": [branch_gpu, branch_gpu, join]},
                     **link)


def test_independent_branches_overlap_when_transfers_are_cheap():
    groups = group(two_branches())
    placement = place(groups, _costs(10e-3, 10e-3))
    assert placement.mixed
    assert sorted(placement.devices[:2]) == ["cpu", "cuda"]
    # the host issues the GPU branch before it runs the CPU one: else they would not overlap
    assert placement.devices[placement.order[0]] == "cuda"
    assert placement.makespan < 0.6 * min(placement.single.values())
    assert "overlap" in placement.reason
    assert "group 0 on" in placement.explain(groups)


def test_a_cpu_group_issued_first_would_hold_the_gpu_branch_back():
    """The simulation runs what the runtime runs: one host thread. Issued CPU-first, the
    GPU branch would start only when the CPU branch ends."""
    from opweave.schedule.placement import _producers, _simulate

    groups = group(two_branches())
    rank = [2.0, 1.0, 0.0]  # rank alone would put the CPU branch first
    order, finish = _simulate(groups, _producers(groups), rank, ["cpu", "cuda", "cpu"],
                              _costs(10e-3, 10e-3))
    assert order == [1, 0, 2]
    assert finish[1] < 11e-3 and finish[0] < 11e-3


def test_transfers_that_dominate_keep_one_device():
    groups = group(two_branches())
    placement = place(groups, _costs(10e-3, 10e-3, latency=30e-3))
    assert not placement.mixed
    assert placement.devices == ["cpu"] * 3  # the inputs are on the CPU: no transfer at all
    assert placement.makespan == min(placement.single.values())
    assert "all on the cpu" in placement.reason


def test_a_much_faster_gpu_takes_everything():
    groups = group(two_branches())
    placement = place(groups, _costs(10e-3, 1e-3))
    assert placement.devices == ["cuda"] * 3
    assert placement.makespan < 3e-3


def test_the_schedule_respects_dependencies_and_transfer_times():
    groups = group(two_branches())
    costs = _costs(10e-3, 10e-3, latency=1e-3)
    placement = place(groups, costs)
    assert placement.order.index(2) > max(placement.order.index(0), placement.order.index(1))
    # the join waits for the branch on the other device plus one transfer
    other = next(i for i in (0, 1) if placement.devices[i] != placement.devices[2])
    assert placement.finish[2] >= placement.finish[other] + costs.latency + 1e-4 - 1e-12


def test_placed_executor_runs_groups_in_the_placement_order_with_their_own_plans():
    """Each group extracted as a graph of its own and compiled by the caller's function
    (here the middle one as Triton kernels, the others as C++, all on the CPU), issued in
    the placement's order: the same result as the whole graph."""
    import pytest

    from opweave.codegen import lower
    from opweave.codegen.triton.kernel import available
    from opweave.runtime import Executor
    from opweave.schedule.placed import PlacedExecutor
    from opweave.schedule.placement import Placement

    if not available():
        pytest.skip("Triton is not installed (pip install 'opweave[triton]')")
    g = two_branches(8)
    g.outputs.append(g.nodes[-2].outputs[0])  # the tanh branch is returned too
    built = []

    def compile_group(sub, device):
        target = "triton" if sub.name.endswith("_g1") else "cpp"
        built.append((sub.name, target))
        return Executor(sub, steps=lower(sub, "ilp", measure=False, target=target).steps)

    groups = group(g)
    placement = Placement(["cpu"] * 3, [1, 0, 2], 0.0, {"cpu": 0.0}, [0.0] * 3, "forced")
    run = PlacedExecutor(g, groups, placement, compile_group)
    assert [t for _, t in built] == ["cpp", "triton", "cpp"]
    x = torch.randn(8, 8)
    for got, want in zip(run(x), Executor(g)(x)):
        torch.testing.assert_close(got, want)
    assert [len(ns) for ns in run.step_nodes()] == [2, 2, 1]


def test_auto_without_a_gpu_runs_on_the_cpu_and_says_so():
    import pytest

    import opweave

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(2, 8)
    compiled = opweave.compile(model, (x,), device="auto")
    torch.testing.assert_close(compiled(x), model(x))
    (graph,) = compiled.program.compiled_graphs
    assert graph.report("placement") == "placement: all on the cpu (no CUDA GPU)"


def test_cuda_without_a_gpu_is_a_clear_error():
    import pytest

    import opweave

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="device='cuda' was asked for .* sees no CUDA GPU"):
        opweave.compile(model, (torch.randn(1, 4),), device="cuda")


def test_a_linear_layer_keeps_its_transposed_weight_in_its_group():
    """The layout pass stores weights transposed and reads them through a permute: the
    view travels with the constant, so the matmul's group reads only activations and
    stays a linear layer (with its library form) once extracted."""
    from opweave.schedule.placed import group_graph

    from ..partition.graphs import mlp_block

    g = mlp_block(rows=8, width=16, hidden=32)
    groups = group(g)
    assert all(n.op != "permute" for s in groups for n in s.nodes)
    assert all(v.producer is None or v.producer.op != "permute" for s in groups for v in s.inputs)
    for sub in groups:
        extracted = group_graph(g, sub)
        assert [v.type for v in extracted.inputs] == [v.type for v in sub.inputs]


def test_costs_are_measured_per_group_on_each_device():
    """measure_costs compiles each group for each device it is asked about and times it
    (here the CPU alone: the link's figures stay the defaults without a GPU)."""
    from opweave.codegen import lower
    from opweave.runtime import Executor
    from opweave.schedule.placed import measure_costs

    g = two_branches(16)
    groups = group(g)
    compiled = []

    def compile_group(sub, device):
        compiled.append((sub.name, device))
        return Executor(sub, steps=lower(sub, "ilp", measure=False).steps)

    costs = measure_costs(g, groups, compile_group, devices=("cpu",), rounds=3)
    assert [d for _, d in compiled] == ["cpu"] * 3
    assert len(costs.seconds["cpu"]) == 3 and all(t > 0 for t in costs.seconds["cpu"])
    assert place(groups, costs).devices == ["cpu"] * 3
