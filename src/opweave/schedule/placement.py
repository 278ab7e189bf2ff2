"""CPU/GPU placement (DUET): group the graph's operators into subgraphs, cost each on both
devices, and place them so that independent CPU and GPU work overlaps, transfers counted.

1. Grouping (`group`), communication-aware as EAGLE's grouping: operators are merged
   along the graph's chains (a node joins its producer's group when it is that group's
   only reader and reads only that group), so no tensor inside a chain ever crosses
   devices, and branches stay separate groups: where the graph forks, work can overlap.
2. Costs (`CostTable`): seconds per group on each device (measured by
   schedule/placed.py, or given: tests use simulated devices) and the link's bandwidth and
   latency.
3. Placement (`place`): list scheduling in the order of HEFT's upward rank (a group's cost
   plus the longest path of costs and transfers after it); each group goes to the device
   where it would finish first, counting the transfers of inputs produced on the other
   device. GPU work is asynchronous to the host, so a GPU group issued before a CPU group
   runs beside it. DUET's correction step: the schedule is kept only when its makespan
   beats every single-device schedule; otherwise the whole graph runs on the faster device.
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
    """The graph's non-constant nodes in chains (see the module's docstring), in
    topological order of the groups."""
    nodes = [n for n in graph.nodes if n.op != "constant"]
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


def _constant(v: Value) -> bool:
    return v.producer is not None and v.producer.op == "constant"


def _producers(groups: list[Subgraph]) -> list[list[int]]:
    made = {v: g.index for g in groups for v in g.outputs}
    return [sorted({made[v] for v in g.inputs if v in made}) for g in groups]


def place(groups: list[Subgraph], costs: CostTable) -> Placement:
    """Each group's device and the issue order (see the module's docstring)."""
    preds = _producers(groups)
    succs: list[list[int]] = [[] for _ in groups]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    devices = [d for d in DEVICES if d in costs.seconds]
    rank = [0.0] * len(groups)
    for i in reversed(range(len(groups))):  # groups are in topological order
        mean = sum(costs.seconds[d][i] for d in devices) / len(devices)
        rank[i] = mean + max((costs.transfer(groups[s].bytes_in(groups[i])) + rank[s]
                              for s in succs[i]), default=0.0)
    single = {d: sum(costs.seconds[d]) + (0.0 if d == costs.home else sum(
        costs.transfer(g.bytes_from_caller()) + costs.transfer(g.bytes_to_caller())
        for g in groups)) for d in devices}
    order, finish, where = _list_schedule(groups, preds, rank, costs, devices)
    makespan = max(finish, default=0.0)
    best = min(single, key=single.get)
    if makespan < single[best] * (1 - 1e-9) and len(set(where)) > 1:
        reason = (f"CPU and GPU overlap: {makespan * 1e3:.3f} ms against {single[best] * 1e3:.3f} "
                  f"ms on the {best} alone")
        return Placement(where, order, makespan, single, finish, reason)
    finish_one, t = [0.0] * len(groups), 0.0
    for i, g in enumerate(groups):
        t += costs.seconds[best][i]
        if best != costs.home:
            t += costs.transfer(g.bytes_from_caller()) + costs.transfer(g.bytes_to_caller())
        finish_one[i] = t
    reason = (f"all on the {best}: splitting the graph would take {makespan * 1e3:.3f} ms "
              f"with transfers, against {single[best] * 1e3:.3f} ms")
    return Placement([best] * len(groups), list(range(len(groups))), single[best], single,
                     finish_one, reason)


def _list_schedule(groups, preds, rank, costs: CostTable, devices):
    """HEFT: ready groups by descending rank, each on the device it finishes first on."""
    free = dict.fromkeys(devices, 0.0)
    finish = [0.0] * len(groups)
    where = [devices[0]] * len(groups)
    waiting = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in groups]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    order = []
    while ready:
        ready.sort(key=lambda i: (-rank[i], i))
        i = ready.pop(0)
        best_device, best_end = None, None
        for d in devices:
            start = free[d]
            if d != costs.home:
                start += costs.transfer(groups[i].bytes_from_caller())
            for p in preds[i]:
                arrival = finish[p]
                if where[p] != d:
                    arrival += costs.transfer(groups[i].bytes_in(groups[p]))
                start = max(start, arrival)
            end = start + costs.seconds[d][i]
            if d != costs.home:
                end += costs.transfer(groups[i].bytes_to_caller())
            if best_end is None or end < best_end - 1e-12:
                best_device, best_end = d, end
        where[i], finish[i] = best_device, best_end
        free[best_device] = best_end
        order.append(i)
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    return order, finish, where
