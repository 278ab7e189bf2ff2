"""No import cycles between the packages (and top-level modules) of src/opweave: the
compiler's layers depend in one direction. Imports inside functions count too."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "opweave"
# Entry points that may reach everything and that nothing in the compiler imports.
ENTRY = {"__init__", "cli", "demo"}


def unit(module: str) -> str:
    """opweave.codegen.lower -> codegen; opweave.options -> options."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("opweave")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("opweave"):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names
                          if (SRC.parent / f"{target}.{a.name}".replace(".", "/")).exists()}
    return found


def dependency_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        src = unit(module_name(path))
        for target in imports(path):
            dst = unit(target)
            if dst != src and dst != "__init__":
                graph.setdefault(src, set()).add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                found.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return found


def test_no_import_cycles_between_packages():
    graph = dependency_graph()
    assert "codegen" in graph and "partition" in graph["codegen"]  # the scan sees imports
    assert cycles(graph) == []


def test_the_compiler_never_imports_tooling_or_entry_points():
    graph = dependency_graph()
    compiler = {"ir", "passes", "partition", "codegen", "runtime", "cost", "frontends", "onnx",
                "options", "pipeline", "notices", "files"}
    for package in compiler:
        assert not graph.get(package, set()) & ({"tools", "bench"} | ENTRY), package
