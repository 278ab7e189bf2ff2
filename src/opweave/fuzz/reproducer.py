"""A failure written as a standalone script: the graph in IR text, its inputs and
constants as tensor literals (exact: floats by repr), and the path to run."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..files import atomic_write
from ..ir import print_graph
from . import oracle

_TEMPLATE = '''"""opweave fuzz reproducer: {paths_text} {summary}.

    {kind}: {message}

Found by `opweave fuzz` (graph seed {seed}), minimised to {nodes} node(s).
Run `python {filename}`: it prints the outcome and exits 1 while the failure reproduces.
"""
import sys

import torch

from opweave.fuzz.check import check_path
from opweave.fuzz.oracle import Case
from opweave.ir import parse_graph

PATHS = {paths!r}
SEED = {seed}
GRAPH = """\\
{graph}"""
INPUTS = [
{inputs}]
CONSTANTS = {{
{constants}}}


def main() -> int:
    failed = False
    for path in PATHS:
        outcome = check_path(path, Case(parse_graph(GRAPH, CONSTANTS), INPUTS), SEED)
        print(f"{{outcome.path}}: {{outcome.status}} {{outcome.kind}} {{outcome.message}}".strip())
        failed = failed or outcome.failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
'''

_DTYPE_NAMES = {torch.float32: "torch.float32", torch.float64: "torch.float64",
                torch.float16: "torch.float16", torch.bfloat16: "torch.bfloat16",
                torch.int64: "torch.int64", torch.int32: "torch.int32",
                torch.int16: "torch.int16", torch.int8: "torch.int8",
                torch.uint8: "torch.uint8", torch.bool: "torch.bool"}


def tensor_literal(t: torch.Tensor) -> str:
    """Python source that rebuilds `t` exactly (shape, dtype, values)."""
    dtype = _DTYPE_NAMES[t.dtype]
    shape = tuple(t.shape)
    if t.numel() == 0:
        return f"torch.empty({shape}, dtype={dtype})"
    flat = t.detach().reshape(-1)
    if t.is_floating_point():
        items = [repr(float(x)) for x in flat.double().tolist()]
    elif t.dtype == torch.bool:
        items = [str(bool(x)) for x in flat.tolist()]
    else:
        items = [str(int(x)) for x in flat.tolist()]
    values = "[" + ", ".join(items) + "]"
    return f"torch.tensor({values}, dtype={dtype}).reshape({shape})"


def write(directory: "str | os.PathLike", name: str, case: oracle.Case, *, path, seed: int,
          kind: str, message: str) -> Path:
    """Write the reproducer `directory/name.py` atomically; returns its path. `path`: the
    path that fails, or a list of paths to run."""
    target = Path(directory) / f"{name}.py"
    paths = [path] if isinstance(path, str) else list(path)
    summary = {"mismatch": "differs from eager", "running": "was running when the fuzzer stopped"}
    summary = summary.get(kind, "fails")
    text = _TEMPLATE.format(
        paths=paths, paths_text=f"the {paths[0]} path" if len(paths) == 1 else "paths " + ", ".join(paths),
        summary=summary, kind=kind, message=message.replace('"""', "'''").replace("\\", "\\\\"),
        seed=seed, nodes=sum(1 for n in case.graph.nodes if n.op != "constant"),
        filename=target.name, graph=print_graph(case.graph).replace("\\", "\\\\"),
        inputs="".join(f"    {tensor_literal(t)},\n" for t in case.inputs),
        constants="".join(f"    {k!r}: {tensor_literal(v)},\n"
                          for k, v in sorted(case.graph.constants.items())))
    return atomic_write(target, lambda tmp: tmp.write_text(text))
