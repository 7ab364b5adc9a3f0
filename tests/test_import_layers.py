"""shardrl's modules import downward only: the import graph, read from the source (imports inside functions
and under `if TYPE_CHECKING:` included), has no cycle, and no backend imports another backend."""

from __future__ import annotations

import ast
from pathlib import Path

import shardrl

PACKAGE = Path(shardrl.__file__).parent


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the shardrl package (packages by their __init__)."""
    out = {}
    for file in PACKAGE.rglob("*.py"):
        parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = file
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the shardrl modules it imports anywhere in its source. `from a.b import c` counts as an
    edge to `a.b.c` when that is a module, else to `a.b`. A package's own `__init__`, which Python runs
    before any of its submodules, is not counted as imported by them (its re-exports would make every
    package a cycle)."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, file in files.items():
        is_package = file.name == "__init__.py"
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                for alias in node.names:
                    if f"{base}.{alias.name}" in files:
                        graph[name].add(f"{base}.{alias.name}")
                    elif base in files:
                        graph[name].add(base)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "shardrl.engine.base" in graph["shardrl.engine.fsdp2"]
    assert len(graph) > 40  # every module was read


def test_shardrl_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert found == [], "import cycles (a lower module imports a higher one):\n" + "\n".join(described)


def test_backends_do_not_import_each_other():
    graph = import_graph()
    backends = {"engine": ["shardrl.engine.fsdp1", "shardrl.engine.fsdp2"],
                "rollout": ["shardrl.rollout.hf", "shardrl.rollout.fast.rollout"]}
    for layer, names in backends.items():
        for name in names:
            others = set(names) - {name}
            assert not graph[name] & others, f"{layer} backend {name} imports {sorted(graph[name] & others)}"
    lower = [m for m in graph if m.startswith(("shardrl.engine", "shardrl.rollout"))]
    for name in lower:  # the engine and the rollout never reach up into the trainer or the run's checkpoints
        above = {m for m in graph[name] if m.startswith("shardrl.trainer") or m == "shardrl.trainer.checkpoint"}
        assert not above, f"{name} imports {sorted(above)}, a layer above it"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """`graph` with each subpackage's modules taken as one node (shardrl.trainer.rl -> shardrl.trainer); a
    top-level module (shardrl.plan.memory) is a node of its own."""
    def node(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(node(module), set()).update(node(d) for d in deps if node(d) != node(module))
    return out


def test_packages_import_downward_only():
    """Also between packages: a top-level module that a package imports (the trainer imports memory) never
    imports back into that package, even one module of it (memory importing trainer.perf was such a cycle)."""
    assert cycles(package_graph({"p.a.x": {"p.b"}, "p.b": {"p.a.y"}, "p.a.y": set()})) == [["p.a", "p.b"]]
    graph = package_graph(import_graph())
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found]
    assert found == [], "import cycles between packages:\n" + "\n".join(described)
