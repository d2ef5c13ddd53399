"""The shape of the code: the project's Python imports form no cycle, the packages depend in one
direction (rewriter → models → custom_ops), and inside the rewriter the layers hold: the kit
imports no backend, builders import no backend, backends import neither the pipeline nor each
other. Imports inside functions count too (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rewriter", "models", "custom_ops")
ORDER = {"rewriter": 0, "models": 1, "custom_ops": 2}       # a package may import only later ones


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module → the project modules it imports (a `from pkg import name` of a submodule counts as
    an import of the submodule)."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")[: len(mod.split(".")) - node.level + (1 if is_pkg else 0)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module
                targets = [(name, [a.name for a in node.names])]
            else:
                continue
            for name, names in targets:
                subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in mods]
                if subs:
                    edges.update(subs)
                if len(subs) < len(names) or not names:
                    while name and name not in mods:
                        name = name.rpartition(".")[0]
                    if name:
                        edges.add(name)
        edges.discard(mod)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, …, a], or None."""
    state: dict[str, int] = {}          # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph(project_modules())


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_import_graph_reads_relative_and_lazy_imports(graph):
    assert "rewriter.kit.surgery" in graph["rewriter.backends.tt"]          # from ..kit import surgery
    assert "custom_ops.schema" in graph["custom_ops.reference.ext"]          # from .. import schema
    assert "models.cache" in graph["rewriter.kit.timing"]                   # inside a function


def test_no_import_cycle(graph):
    assert find_cycle(graph) is None, f"import cycle: {' → '.join(find_cycle(graph))}"


def test_packages_depend_one_way(graph):
    bad = [(a, b) for a, deps in graph.items() for b in deps
           if ORDER[a.split(".")[0]] > ORDER[b.split(".")[0]]]
    assert not bad, f"imports against rewriter → models → custom_ops: {bad}"


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_rewriter_layers(graph):
    upper = ("rewriter.backends", "rewriter.builders", "rewriter.pipeline", "rewriter.cli", "rewriter.report",
             "rewriter.evaluate")
    problems = []
    for mod, deps in graph.items():
        for dep in deps:
            if _under(mod, "rewriter.kit") and _under(dep, *upper):
                problems.append(f"{mod} (kit) imports {dep}")
            if _under(mod, "rewriter.builders") and _under(dep, *upper) and not _under(dep, "rewriter.builders"):
                problems.append(f"{mod} (builder) imports {dep}")
            if _under(mod, "rewriter.backends") and mod != "rewriter.backends":
                if _under(dep, "rewriter.pipeline", "rewriter.cli", "rewriter.report", "rewriter.evaluate"):
                    problems.append(f"{mod} (backend) imports {dep}")
                if _under(dep, "rewriter.backends"):
                    problems.append(f"{mod} (backend) imports {dep}: backends share through the kit")
    assert not problems, "\n".join(problems)
