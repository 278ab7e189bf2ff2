"""Chains of reshapes and permutes merged into one permute (passes/view_chains.py)."""
from __future__ import annotations

import random

import pytest
import torch

from opweave.ir import Graph, TensorType
from opweave.passes.view_chains import merge_view_chains
from opweave.runtime import Executor


def _chain(shape, ops, output_too=False):
    g = Graph("views")
    x = g.add_input("x", TensorType(shape, torch.float32))
    v, links = x, []
    for op, arg in ops:
        v = g.add1(op, [v], {"shape": arg} if op == "reshape" else {"dims": arg})
        links.append(v)
    g.outputs = [g.add1("relu", [v])] + ([links[1]] if output_too else [])
    return g


def _merged(shape, ops, output_too=False):
    """How many chains merged, and the views left; the values are the chain's."""
    g = _chain(shape, ops, output_too)
    data = torch.randn(shape)
    want = Executor(g)(data)
    changed = merge_view_chains(g)
    for a, b in zip(Executor(g)(data), want):
        assert torch.equal(a, b)
    return changed, [n.op for n in g.nodes if n.op in ("reshape", "permute")]


MOBILEVIT_UNFOLD = [("reshape", [2304, 2, 16, 2]), ("permute", [0, 2, 1, 3]),
                    ("reshape", [1, 144, 256, 4]), ("permute", [0, 3, 2, 1]),
                    ("reshape", [4, 256, 144])]
MOBILEVIT_FOLD = [("reshape", [1, 4, 256, 144]), ("permute", [0, 3, 2, 1]),
                  ("reshape", [2304, 16, 2, 2]), ("permute", [0, 2, 1, 3]),
                  ("reshape", [1, 144, 32, 32])]


@pytest.mark.parametrize("shape,ops", [((1, 144, 32, 32), MOBILEVIT_UNFOLD),
                                       ((4, 256, 144), MOBILEVIT_FOLD)])
def test_mobilevits_unfold_and_fold_become_one_permute(shape, ops):
    """Two copies (each reshape after a permute) become one."""
    assert _merged(shape, ops) == (1, ["reshape", "permute", "reshape"])


def test_a_chain_that_is_no_permutation_of_axis_factors_stays():
    # [6, 4] transposed is [4, 6]; as [3, 8] its rows mix parts of the 4 and the 6
    ops = [("permute", [1, 0]), ("reshape", [3, 8]), ("permute", [1, 0])]
    assert _merged((6, 4), ops) == (0, ["permute", "reshape", "permute"])


def test_a_link_read_elsewhere_ends_the_chain():
    changed, views = _merged((1, 144, 32, 32), MOBILEVIT_UNFOLD, output_too=True)
    assert changed == 0 and views.count("permute") == 2


def test_random_chains_keep_their_values():
    """Random chains of reshapes (splitting and merging axes, unit axes too) and
    permutes: merged or not, the values are the chain's, to the bit."""
    rng = random.Random(0)
    merged = 0
    for _ in range(200):
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(2, 4))]
        ops, current = [], list(shape)
        for _ in range(rng.randint(2, 6)):
            if rng.random() < 0.5:
                dims = list(range(len(current)))
                rng.shuffle(dims)
                ops.append(("permute", dims))
                current = [current[d] for d in dims]
            else:
                flat = [f for d in current for f in _factors(d, rng)]
                new = _regroup_sizes(flat, rng)
                ops.append(("reshape", new))
                current = new
        changed, _ = _merged(tuple(shape), ops)
        merged += changed
    assert merged > 20  # the test exercises the merge, not only its refusals


def _factors(d: int, rng) -> list[int]:
    for f in (2, 3):
        if d % f == 0 and d > f and rng.random() < 0.5:
            return [f, d // f]
    return [d]


def _regroup_sizes(flat: list[int], rng) -> list[int]:
    out, i = [], 0
    while i < len(flat):
        take = rng.randint(1, 2)
        part = flat[i:i + take]
        out.append(int(torch.tensor(part).prod()))
        i += take
    if rng.random() < 0.3:
        out.insert(rng.randint(0, len(out)), 1)
    return out
