"""The partitioning ILP (EVT/Korch style), solved with HiGHS.

One binary per candidate group; every node of the component is covered exactly once;
the objective is the summed group cost (policy.py) in microseconds. Candidates are
convex, so a cycle can only run through two or more chosen groups; such cycles are
excluded lazily: when a solution contains one, the constraint "not all of these groups"
is added and the ILP solved again (as the rewrite extractor does for e-graph cycles).
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Node
from .context import Context
from .cycles import find_cycle

SCALE = 1e6       # seconds -> microseconds in the objective
MAX_ROUNDS = 20   # lazy cycle cuts before giving up on the ILP for this component


MAX_MIP_NODES = 20_000  # branch-and-bound nodes per solve


class IlpFailed(Exception):
    pass


def solve(ctx: Context, comp: list[Node], cands: list[frozenset[Node]], costs: list[float],
          seconds: float) -> list[frozenset[Node]]:
    import highspy

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("time_limit", float(seconds))
    h.setOptionValue("mip_max_nodes", MAX_MIP_NODES)  # a count: decides alike on any machine
    n = len(cands)
    cols = np.arange(n, dtype=np.int32)
    h.addVars(n, np.zeros(n), np.ones(n))
    h.changeColsCost(n, cols, np.array(costs) * SCALE)
    h.changeColsIntegrality(n, cols, np.array([highspy.HighsVarType.kInteger] * n))
    covering: dict[Node, list[int]] = {node: [] for node in comp}
    for i, group in enumerate(cands):
        for node in group:
            covering[node].append(i)
    for node in comp:
        idx = covering[node]
        h.addRow(1.0, 1.0, len(idx), np.array(idx, dtype=np.int32), np.ones(len(idx)))
    for _ in range(MAX_ROUNDS):
        h.run()
        if h.getInfo().primal_solution_status != 2:  # 2: feasible
            raise IlpFailed(h.modelStatusToString(h.getModelStatus()))
        values = h.getSolution().col_value
        chosen = [i for i in range(n) if values[i] > 0.5]
        cycle = find_cycle(ctx, [cands[i] for i in chosen])
        if cycle is None:
            return [cands[i] for i in chosen]
        idx = [chosen[k] for k in cycle]
        h.addRow(-highspy.kHighsInf, len(idx) - 1.0, len(idx), np.array(idx, dtype=np.int32),
                 np.ones(len(idx)))
    raise IlpFailed(f"still cyclic after {MAX_ROUNDS} cuts")
