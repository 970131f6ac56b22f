"""The package is layered: every import goes down the layers (or stays inside its own unit), no two modules import
each other, directly or through others, and the rules of the speculative subsystem's shape hold.

Imports are read from the source (ast), function-level ones included, so a cycle cannot hide in a late import.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

import hyperdraft

ROOT = os.path.dirname(os.path.abspath(hyperdraft.__file__))

# Units lowest first: a unit may import from its own modules and from units in earlier layers only (never from a
# sibling in its own layer). A unit is a top-level module or package of hyperdraft, or, inside `speculative`, a
# sub-package or top-level module of it.
LAYERS: list[set[str]] = [
    {"options", "sampling_params"},
    {"config", "request"},
    {"core"},
    {"kernels"},
    {"distributed"},  # its push all-reduce is a kernel
    {"models"},
    {"kvcache"},
    {"attention"},
    {"sample"},
    {"runner"},
    {"speculative", "speculative.adaptive", "speculative.proposal", "speculative.metrics"},
    {"speculative.config"},
    {"speculative.drafting"},
    {"speculative.graph_plan"},
    {"speculative.proposer"},
    {"speculative.proposers", "speculative.verify"},
    {"speculative.verify_ahead"},
    {"speculative.worker"},
    {"detokenizer"},  # the engine's stop check decodes through its decode_many
    {"engine"},
    {"llm"},
    {"demo", "server", "training", "testing"},
    {"cli"},
    {"__main__", "__init__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def unit_of(module: str) -> str:
    """hyperdraft-relative module name -> its unit ("speculative.verify.chain" -> "speculative.verify")."""
    parts = module.split(".")
    if parts[0] == "speculative" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def imports() -> dict[str, set[str]]:
    """module -> the hyperdraft modules it imports (relative names; a `from pkg import name` counts pkg.name when that
    is a module)."""
    modules = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                modules[module_name(path)] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for target in targets:
                # `from hyperdraft import x` names module x; the package's own __init__ runs before any of its modules
                # anyway, so importing the package itself is no edge.
                rel = target[len("hyperdraft."):] if target.startswith("hyperdraft.") else None
                if rel in modules and rel != name:
                    graph[name].add(rel)
        graph.setdefault(name, set())
    return graph


GRAPH = imports()


def test_every_unit_has_a_layer():
    missing = sorted({unit_of(m) for m in GRAPH} - set(RANK))
    assert not missing, f"units without a layer in LAYERS: {missing}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    upward = []
    for module, targets in graph.items():
        for target in targets:
            a, b = unit_of(module), unit_of(target)
            if a != b and RANK[b] >= RANK[a]:
                upward.append(f"{module} -> {target} ({a} layer {RANK[a]}, {b} layer {RANK[b]})")
    return sorted(upward)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_imports_only_go_down():
    upward = upward_imports(GRAPH)
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)


def test_no_module_import_cycles():
    cycles = import_cycles(GRAPH)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_catch_what_they_forbid():
    """An upward import, a sideways one, and a cycle through three modules, in a made-up graph."""
    graph = {"core.forward_batch": {"runner.model_runner"}, "runner.model_runner": set(),
             "speculative.verify.chain": {"speculative.proposers.ngram"}, "speculative.proposers.ngram": set(),
             "kernels.a": {"kernels.b"}, "kernels.b": {"kernels.c"}, "kernels.c": {"kernels.a"}}
    assert [u.split(" ")[0] for u in upward_imports(graph)] == ["core.forward_batch", "speculative.verify.chain"]
    assert import_cycles(graph) == [["kernels.a", "kernels.b", "kernels.c"]]


@pytest.mark.parametrize("source,forbidden", [
    ("speculative", "engine"),  # the speculative subsystem never reaches up into the engine that drives it
    ("runner", "speculative"),
    ("core", "runner"),
])
def test_named_boundaries(source, forbidden):
    crossing = [f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
                if m.split(".")[0] == source and t.split(".")[0] == forbidden]
    assert not crossing, crossing


def test_the_graph_has_known_edges():
    """The graph builder resolves `from hyperdraft.x import y` forms: known edges are present."""
    assert "core.forward_batch" in GRAPH["speculative.verify.chain"]
    assert "speculative.proposer" in GRAPH["speculative.proposers.ngram"]
