"""CPU/GPU placement (DUET): group the graph's operators into subgraphs, cost each on both
devices, and place them so that independent CPU and GPU work overlaps, transfers counted.

1. Grouping (`group`), communication-aware as EAGLE's grouping: operators are merged
   along the graph's chains (a node joins its producer's group when it is that group's
   only reader and reads only that group), so no tensor inside a chain ever crosses
   devices, and branches stay separate groups: where the graph forks, work can overlap.
2. Costs (`CostTable`): seconds per group on each device (measured by
   schedule/placed.py, or given: tests use simulated devices) and the link's bandwidth and
   latency.
3. Placement (`place`): HEFT chooses each group's device (ready groups in the order of
   their upward rank, a group's cost plus the longest path of costs and transfers after
   it; each on the device it would finish first on, transfers of inputs made on the
   other device and of the caller's inputs and outputs counted). The choice is then
   simulated as the runtime runs it: one host thread runs the CPU groups and issues the
   GPU ones, which the GPU runs in order; issuing costs the host nothing, so ready GPU
   groups are issued first, and that is where the two overlap. DUET's correction step:
   the simulated mixed schedule is kept only when it beats every single-device schedule,
   simulated the same way; otherwise the whole graph runs on the faster device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Graph
from ..ir.graph import Node, Value

DEVICES = ("cpu", "cuda")


@dataclass
class Subgraph:
    index: int
    nodes: list[Node]
    inputs: list[Value]    # values it reads from other groups or the graph's inputs
    outputs: list[Value]   # values other groups or the caller read
    returns: list[Value] = field(default_factory=list)  # of those, the caller's

    def bytes_in(self, producer: "Subgraph") -> int:
        return sum(_nbytes(v) for v in self.inputs if v in producer.outputs)

    def bytes_from_caller(self) -> int:
        return sum(_nbytes(v) for v in self.inputs if v.producer is None)

    def bytes_to_caller(self) -> int:
        return sum(_nbytes(v) for v in self.returns)


@dataclass
class CostTable:
    """Seconds per subgraph on each device, and the link between them."""

    seconds: dict[str, list[float]]
    bandwidth: float = 16e9   # bytes per second, host <-> device
    latency: float = 10e-6    # seconds per transfer
    home: str = "cpu"         # where the caller's inputs are and its outputs go

    def transfer(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes else 0.0


@dataclass
class Placement:
    devices: list[str]           # per subgraph
    order: list[int]             # the order subgraphs are issued in
    makespan: float
    single: dict[str, float]     # the makespan of running everything on one device
    finish: list[float] = field(default_factory=list)
    reason: str = ""

    @property
    def mixed(self) -> bool:
        return len(set(self.devices)) > 1

    def explain(self, groups: list[Subgraph]) -> str:
        lines = [f"placement: {self.reason}",
                 "  single device: " + ", ".join(f"{d} {t * 1e3:.3f} ms"
                                                 for d, t in self.single.items()),
                 f"  placed: {self.makespan * 1e3:.3f} ms"]
        for i in self.order:
            ops = ", ".join(dict.fromkeys(n.op for n in groups[i].nodes))
            lines.append(f"  group {i} on {self.devices[i]} (ends {self.finish[i] * 1e3:.3f} ms): "
                         f"{len(groups[i].nodes)} ops ({ops})")
        return "\n".join(lines)


def _nbytes(v: Value) -> int:
    n = v.type.nbytes
    return n if isinstance(n, int) else 0


def group(graph: Graph) -> list[Subgraph]:
    """The graph's nodes (but constants and their views) in chains (see the module's
    docstring), in topological order of the groups."""
    nodes = [n for n in graph.nodes if not constant_like(n)]
    readers: dict[Value, list[Node]] = {}
    for n in nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    group_of: dict[Node, int] = {}
    members: list[list[Node]] = []
    for n in nodes:
        producers = {group_of[v.producer] for v in n.inputs if v.producer in group_of}
        if len(producers) == 1:
            (g,) = producers
            tail = members[g][-1]
            outside = {r for v in _values(members[g]) for r in readers.get(v, ()) if r is not n}
            if n in {r for v in tail.outputs for r in readers.get(v, ())} and not outside - set(members[g]):
                members[g].append(n)
                group_of[n] = g
                continue
        group_of[n] = len(members)
        members.append([n])
    wanted = set(graph.outputs)
    groups = []
    for i, ns in enumerate(members):
        inside = set(ns)
        ins = list(dict.fromkeys(v for n in ns for v in n.inputs
                                 if v.producer not in inside and not _constant(v)))
        outs = [v for v in _values(ns) if v in wanted
                or any(r not in inside for r in readers.get(v, ()))]
        groups.append(Subgraph(i, ns, ins, outs, [v for v in outs if v in wanted]))
    return groups


def _values(nodes: list[Node]) -> list[Value]:
    return [v for n in nodes for v in n.outputs]


def constant_like(node: Node) -> bool:
    """A constant, or a view of one (a weight stored transposed is read through a
    permute): each group that reads it holds its own copy, so no weight ever crosses
    devices per call and a linear layer keeps its weight (and its library form)."""
    return node.op == "constant" or (node.opdef.is_view and bool(node.inputs) and all(
        v.producer is not None and constant_like(v.producer) for v in node.inputs))


def _constant(v: Value) -> bool:
    return v.producer is not None and constant_like(v.producer)


def _producers(groups: list[Subgraph]) -> list[list[int]]:
    made = {v: g.index for g in groups for v in g.outputs}
    return [sorted({made[v] for v in g.inputs if v in made}) for g in groups]


def place(groups: list[Subgraph], costs: CostTable) -> Placement:
    """Each group's device and the issue order (see the module's docstring)."""
    preds = _producers(groups)
    succs = _successors(preds)
    devices = [d for d in DEVICES if d in costs.seconds]
    rank = [0.0] * len(groups)
    for i in reversed(range(len(groups))):  # groups are in topological order
        mean = sum(costs.seconds[d][i] for d in devices) / len(devices)
        rank[i] = mean + max((costs.transfer(groups[s].bytes_in(groups[i])) + rank[s]
                              for s in succs[i]), default=0.0)
    runs = {d: _simulate(groups, preds, rank, [d] * len(groups), costs) for d in devices}
    single = {d: max(finish, default=0.0) for d, (_, finish) in runs.items()}
    where = _assign(groups, preds, rank, costs, devices)
    order, finish = _simulate(groups, preds, rank, where, costs)
    makespan = max(finish, default=0.0)
    best = min(single, key=single.get)
    if makespan < single[best] * (1 - 1e-9) and len(set(where)) > 1:
        reason = (f"CPU and GPU overlap: {makespan * 1e3:.3f} ms against {single[best] * 1e3:.3f} "
                  f"ms on the {best} alone")
        return Placement(where, order, makespan, single, finish, reason)
    reason = (f"all on the {best}: splitting the graph would take {makespan * 1e3:.3f} ms "
              f"with transfers, against {single[best] * 1e3:.3f} ms")
    order, finish = runs[best]
    return Placement([best] * len(groups), order, single[best], single, finish, reason)


def _successors(preds: list[list[int]]) -> list[list[int]]:
    succs: list[list[int]] = [[] for _ in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    return succs


def _assign(groups, preds, rank, costs: CostTable, devices) -> list[str]:
    """HEFT's device choice: ready groups by descending rank, each on the device it would
    finish first on, the devices taken as independent."""
    free = dict.fromkeys(devices, 0.0)
    finish = [0.0] * len(groups)
    where = [devices[0]] * len(groups)
    waiting = [len(p) for p in preds]
    succs = _successors(preds)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    while ready:
        ready.sort(key=lambda i: (-rank[i], i))
        i = ready.pop(0)
        best_device, best_end = None, None
        for d in devices:
            start = max([free[d] + _from_caller(groups[i], d, costs)]
                        + [_arrival(groups, finish, where, p, i, d, costs) for p in preds[i]])
            end = start + costs.seconds[d][i] + _to_caller(groups[i], d, costs)
            if best_end is None or end < best_end - 1e-12:
                best_device, best_end = d, end
        where[i], finish[i] = best_device, best_end
        free[best_device] = best_end
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return where


def _simulate(groups, preds, rank, where: list[str], costs: CostTable):
    """(issue order, finish times) of running the groups where `where` says, as the
    runtime runs them: one host thread runs the CPU groups and issues the GPU ones, which
    then run in order on the GPU's stream. Issuing costs the host nothing, so ready GPU
    groups go first; a CPU group reading a GPU value waits for it (and its copy)."""
    host = gpu = 0.0
    finish = [0.0] * len(groups)
    waiting = [len(p) for p in preds]
    succs = _successors(preds)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        ready.sort(key=lambda i: (where[i] != "cuda", -rank[i], i))
        i = ready.pop(0)
        d = where[i]
        start = max([host + _from_caller(groups[i], d, costs)]
                    + [_arrival(groups, finish, where, p, i, d, costs) for p in preds[i]])
        if d == "cuda":
            start = max(start, gpu)
            gpu = start + costs.seconds[d][i]
            finish[i] = gpu + _to_caller(groups[i], d, costs)
        else:
            host = start + costs.seconds[d][i]
            finish[i] = host + _to_caller(groups[i], d, costs)
        order.append(i)
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return order, finish


def _arrival(groups, finish, where, p: int, i: int, device: str, costs: CostTable) -> float:
    """When group p's outputs that group i reads are on `device`."""
    moved = costs.transfer(groups[i].bytes_in(groups[p])) if where[p] != device else 0.0
    return finish[p] + moved


def _from_caller(group: Subgraph, device: str, costs: CostTable) -> float:
    return costs.transfer(group.bytes_from_caller()) if device != costs.home else 0.0


def _to_caller(group: Subgraph, device: str, costs: CostTable) -> float:
    return costs.transfer(group.bytes_to_caller()) if device != costs.home else 0.0
