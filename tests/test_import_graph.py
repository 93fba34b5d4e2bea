"""Layers import downward, and no module imports itself back (docs/architecture.md, "Layers").

Every ``.py`` file of the distribution's folders is parsed with :mod:`ast` (nothing is imported). An edge is
each ``import X`` / ``from X import name`` that names one of our modules, resolved to the module file it loads
(``from pkg import sub`` is an edge to ``pkg.sub`` when ``sub`` is a module; relative imports are resolved).

Which imports count:

- module-level imports and **function-local** imports both count, for the layers and for cycles: a local import
  still runs, at the first call, and a cycle closed through it is still a circle a reader has to walk;
- imports under ``if TYPE_CHECKING:`` count for the **layers** (an upward type reference is still an upward
  dependency of the design) but **not for cycles**: they never execute, and an annotation-only reference inside
  one layer is the usual way to type a back reference without a runtime circle.

The layers, bottom to top (a module may import its own layer's folder and any lower layer, never a higher one
and never a sibling folder of the same rank):

0. base: ``specstream.errors`` (typed errors), ``specstream.types`` (plain data shared across layers),
   ``specstream.helptext`` (docstrings as --help text), ``specstream.threadpolicy`` (the OpenMP wait policy, set
   before torch loads); these import nothing of ours but each other
1. ``kernels``
2. ``schedulers`` and ``modalities`` (siblings: neither imports the other)
3. ``stages``
4. ``pipeline``
5. the public face: ``specstream`` (``__init__``: the public API, lazily), ``specstream.cli``,
   ``specstream.__main__``, ``specstream.api``

The benchmarks (``specstream.pipeline.bench``) are in the pipeline layer, and only the CLI (its bench commands)
and the benchmarks themselves import them.

A failure names each offending module, line and imported module.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folder -> package name (pyproject's package-dir)
FOLDERS = {
    "specstream": "specstream",
    "pipeline": "specstream.pipeline",
    "stages": "specstream.stages",
    "modalities": "specstream.modalities",
    "kernels": "specstream.kernels",
    "schedulers": "specstream.schedulers",
}

BASE = ("specstream.errors", "specstream.types", "specstream.helptext", "specstream.threadpolicy")


@dataclass(frozen=True)
class Edge:
    """One import statement: ``src`` (module) imports ``dst`` (module) at ``path:line``."""

    src: str
    dst: str
    path: str
    line: int
    type_checking: bool


def layer_of(module: str) -> tuple[int, str]:
    """(rank, group) of a module: a higher rank may import a lower one; equal rank needs the same group."""
    for base in BASE:
        if module == base or module.startswith(base + "."):
            return 0, "base"
    parts = module.split(".")
    group = parts[1] if len(parts) > 1 else ""
    ranks = {"kernels": 1, "schedulers": 2, "modalities": 2, "stages": 3, "pipeline": 4}
    if group in ranks:
        return ranks[group], group
    return 5, "face"  # specstream/__init__, cli, __main__, api


def module_files(root: Path) -> dict[str, Path]:
    """Every module name of the distribution under ``root`` -> its file."""
    out: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        base = root / folder
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "static"))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                rel = Path(dirpath, name).relative_to(base).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"]
                out[".".join([package, *parts])] = Path(dirpath, name)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, under TYPE_CHECKING) for every Import/ImportFrom node, at any depth (function bodies included)."""
    stack = [(tree, False)]
    while stack:
        node, tc = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, tc
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True) for child in node.body)
            stack.extend((child, tc) for child in node.orelse)
            continue
        stack.extend((child, tc) for child in ast.iter_child_nodes(node))


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import edge between our modules under ``root``, in file and line order."""
    files = module_files(root)
    found: list[Edge] = []
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = str(path.relative_to(root))
        for node, tc in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    name = alias.name
                    while name and name not in files:  # `import a.b.c` loads a.b.c (a module or package)
                        name = name.rpartition(".")[0]
                    if name and name.startswith("specstream"):
                        targets.append(name)
            else:
                if node.level:
                    anchor = module.split(".") if is_package else module.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if not base.startswith("specstream"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in files:
                        targets.append(sub)
                    elif base in files:
                        targets.append(base)
            for dst in dict.fromkeys(targets):
                if dst != module:
                    found.append(Edge(module, dst, rel, node.lineno, tc))
    return sorted(found, key=lambda e: (e.path, e.line, e.dst))


def upward(all_edges: list[Edge]) -> list[Edge]:
    """Edges that import a higher layer, or a sibling folder of the same rank."""
    bad = []
    for e in all_edges:
        (rs, gs), (rd, gd) = layer_of(e.src), layer_of(e.dst)
        if rd > rs or (rd == rs and gd != gs and rs != 0):
            bad.append(e)
    return bad


def cycles(all_edges: list[Edge]) -> list[list[Edge]]:
    """Circles of runtime imports (TYPE_CHECKING ones left out): one edge list per strongly connected group,
    as a shortest circle through the group's first module."""
    graph: dict[str, list[Edge]] = {}
    for e in all_edges:
        if not e.type_checking:
            graph.setdefault(e.src, []).append(e)
    # Tarjan's strongly connected components, iterative
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            out = graph.get(node, [])
            if i < len(out):
                work.append((node, i + 1))
                nxt = out[i].dst
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    circles = []
    for group in sorted(groups):
        members = set(group)
        start = group[0]
        # breadth-first shortest path back to start inside the group
        prev: dict[str, Edge] = {}
        frontier, seen, closing = [start], {start}, None
        while frontier and closing is None:
            nxt_frontier = []
            for node in frontier:
                for e in graph.get(node, []):
                    if e.dst == start:
                        closing = e
                        break
                    if e.dst in members and e.dst not in seen:
                        seen.add(e.dst)
                        prev[e.dst] = e
                        nxt_frontier.append(e.dst)
                if closing is not None:
                    break
            frontier = nxt_frontier
        path = [closing]
        node = closing.src
        while node != start:
            path.append(prev[node])
            node = prev[node].src
        circles.append(path[::-1])
    return circles


def report(root: Path = ROOT) -> list[str]:
    """One line per violation: upward imports, then circles."""
    all_edges = edges(root)
    lines = [
        f"upward import: {e.src} ({e.path}:{e.line}{', TYPE_CHECKING' if e.type_checking else ''}) imports "
        f"{e.dst} (layer {layer_of(e.src)[1]} -> {layer_of(e.dst)[1]})"
        for e in upward(all_edges)
    ]
    for circle in cycles(all_edges):
        lines.append("import cycle: " + " -> ".join(f"{e.src} ({e.path}:{e.line})" for e in circle)
                     + f" -> {circle[0].src}")
    return lines


def test_layers_import_downward_without_cycles():
    problems = report()
    assert not problems, f"{len(problems)} import-graph violations:\n" + "\n".join(problems)


def test_only_the_cli_imports_the_benchmarks():
    """``pipeline/bench/`` (layer pipeline) is imported by the CLI's bench commands and by its own modules only:
    no product module depends on a benchmark."""
    bench = "specstream.pipeline.bench"
    wrong = [f"{e.src} ({e.path}:{e.line}) imports {e.dst}" for e in edges()
             if (e.dst == bench or e.dst.startswith(bench + "."))
             and not (e.src == "specstream.cli" or e.src == bench or e.src.startswith(bench + "."))]
    assert not wrong, "\n".join(wrong)
    assert any(e.src == "specstream.cli" and e.dst.startswith(bench + ".") for e in edges())


def test_graph_sees_local_relative_and_type_checking_imports(tmp_path):
    """The walker on a hand-made tree: a local upward import, a relative import, a TYPE_CHECKING-only
    back reference (layer checked, no cycle) and a runtime circle."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "kernels" / "k.py").write_text(
        "def f():\n    from specstream.stages.s import X\n")
    (tmp_path / "stages" / "s.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import t\nif TYPE_CHECKING:\n    from specstream.stages import u\n")
    (tmp_path / "stages" / "t.py").write_text("import specstream.stages.s\n")
    (tmp_path / "stages" / "u.py").write_text("from specstream.stages.s import X\n")
    (tmp_path / "schedulers" / "q.py").write_text("from specstream.modalities import m\n")
    (tmp_path / "modalities" / "m.py").write_text("from specstream.errors import E\n")
    (tmp_path / "specstream" / "errors.py").write_text("")
    assert report(tmp_path) == [
        "upward import: specstream.kernels.k (kernels/k.py:2) imports specstream.stages.s (layer kernels -> stages)",
        "upward import: specstream.schedulers.q (schedulers/q.py:1) imports specstream.modalities.m "
        "(layer schedulers -> modalities)",
        "import cycle: specstream.stages.s (stages/s.py:2) -> specstream.stages.t (stages/t.py:1) "
        "-> specstream.stages.s",
    ]
