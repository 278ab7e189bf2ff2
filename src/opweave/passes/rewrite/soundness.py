"""Check a rule numerically: build each example's left-hand side, rewrite it with the rule,
and run both on random inputs through the reference executor.

A rule fails when an example does not match or is rejected (the example, or the rule, is
wrong), when the rewritten graph does not verify, or when any output differs beyond float
tolerance on any of a few random inputs.
"""
from __future__ import annotations

import torch

from ...ir import Graph, TensorType
from ...runtime import Executor
from .pattern import build_index, find
from .rule import Builder, Reject, Rule
from .term import ENode, Store, TermDag, to_graph

RTOL, ATOL = 1e-4, 1e-5


def example_dag(rule: Rule, index: int) -> tuple[TermDag, list[int], Graph]:
    """The example's left-hand side as a dag, its root classes, and a template graph
    holding its inputs."""
    ex = rule.examples[index]
    store = Store()
    dag = TermDag(store)
    template = Graph(f"{rule.name}_example")
    for k, shape in enumerate(ex.shapes):
        t = TensorType(tuple(shape), ex.dtype)
        dag.inputs.append(dag.add(ENode("input", (("index", k),)), t))
        template.add_input(f"in{k}", t)
    root = ex.build(Builder(dag, dag, store), *dag.inputs)
    dag.roots = [root] if isinstance(root, int) else list(root)
    return dag, dag.roots, template


def rewrite_example(rule: Rule, dag: TermDag, roots: list[int]) -> list[int]:
    """The rule applied at the example's roots: the replacement classes, in root order."""
    why = "no match at the example's root"
    for m in find(dag, rule.lhs, build_index(dag)):
        if sorted(m.roots) != sorted(roots):
            continue
        try:
            new = rule.apply(Builder(dag, dag, dag.store, rule.name), m)
        except Reject as err:
            why = f"rejected: {err}"
            continue
        return [new[m.roots.index(r)] for r in roots]
    raise Reject(why)


def run(dag: TermDag, roots: list[int], template: Graph, inputs) -> list[torch.Tensor]:
    graph = to_graph(dag.node_of, roots, template, dag.store)
    return Executor(graph)(*inputs)


def check_rule(rule: Rule, seeds: int = 3) -> list[str]:
    """What is wrong with `rule`, one line per problem (empty: sound on its examples)."""
    problems = []
    for i in range(len(rule.examples)):
        where = f"{rule.name} example {i}"
        try:
            dag, roots, template = example_dag(rule, i)
            new_roots = rewrite_example(rule, dag, roots)
        except Reject as err:
            problems.append(f"{where}: the rule does not apply ({err})")
            continue
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            inputs = [_random(v.type, gen) for v in template.inputs]
            try:
                before = run(dag, roots, template, inputs)
                after = run(dag, new_roots, template, inputs)
            except Exception as err:  # a rule that builds an unrunnable graph is unsound
                problems.append(f"{where}: {type(err).__name__}: {err}")
                break
            for k, (a, e) in enumerate(zip(after, before)):
                if a.dtype != e.dtype or a.shape != e.shape:
                    problems.append(f"{where}: output {k} is {a.dtype}{list(a.shape)}, "
                                    f"expected {e.dtype}{list(e.shape)}")
                elif not torch.allclose(a, e, rtol=RTOL, atol=ATOL, equal_nan=True) \
                        if a.is_floating_point() else not torch.equal(a, e):
                    diff = (a.double() - e.double()).abs().nan_to_num(float("inf")).max().item()
                    problems.append(f"{where}: output {k} differs by {diff:.3g} (seed {seed})")
            if problems:
                break
    return problems


def _random(t: TensorType, gen: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, generator=gen).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) > 0.5
    return torch.randint(0, 3, t.shape, generator=gen).to(t.dtype)
