"""The rooms of the house stay rooms: which package may import which, and no import cycles.

A structural check read from the source with :mod:`ast`; nothing is imported or run. Every module of
the packages in :data:`PACKAGES` is parsed and **every** import statement in it is collected: module
level, inside functions and methods (the deferred ``from engine.checkpoint import ...`` that hides a
cycle from the interpreter still counts), inside ``try`` and ``if`` blocks, and inside
``if TYPE_CHECKING:`` blocks too. TYPE_CHECKING imports count because they are dependencies of the design
all the same (a type checker and a reader follow them); a layering that holds only at run time is not a
layering.

How an import becomes an edge ``module -> imported module``:

* relative imports are resolved against the importing module's package (``from .x import y`` in
  ``engine/export/source.py`` is ``engine.export.x``; in a package's ``__init__.py`` the package is the
  module itself);
* ``import a.b.c`` points at ``a.b.c``; ``from a.b import name`` points at ``a.b.name`` when that is a
  module of the tree, else at ``a.b``; a package stands for its ``__init__.py`` (module ``a.b``);
* as Python does, importing ``a.b.c`` from outside package ``a.b`` first runs ``a.b``'s ``__init__``
  (and ``a``'s, if outside ``a``): those are edges too ("runs the package __init__"). From inside a
  package its own ``__init__`` has already run, so a submodule importing a sibling is no edge to the
  ``__init__`` that re-exports it. This is how ``from ..ps import routing`` in ``engine.checkpoint``
  reaches ``engine.ps.server``;
* a module that imports by name at run time (``importlib.import_module``, ``__import__``) gets an edge
  to every module of the tree whose full dotted name appears in it as a string literal (the registry
  of ``engine.programs``: ``PROGRAMS = {"ctr_dnn": "engine.programs.ctr", ...}``);
* imports of anything outside the tree (numpy, pyarrow, the standard library) are not edges.

Without the last two kinds of edge the walk misses cycles that exist: ``engine.ps`` <-> ``engine.checkpoint``
closes only through ``engine/ps/__init__.py``, and ``engine.config`` <-> ``engine.programs`` only through the
programs registry.

Rules (DESIGN.md, "The top-level folders are the rooms of the house"):

1. a package never imports the packages in :data:`FORBIDDEN` (``engine`` composes the others; nothing
   below imports it);
2. a lower package (all but ``engine``) never imports a private module (a dotted-name part starting
   with ``_``, dunders like ``__init__`` aside) of ANOTHER package: what one room offers another is
   public and documented;
3. the module import graph has no cycle: no strongly connected component of more than one module, and
   no module importing itself.

Failure messages name the importing file and line; for a cycle, its modules and each distinct shortest
loop through them, step by step (one component often merges loops that need separate fixes).
"""
from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: the packages walked (the rooms of DESIGN.md)
PACKAGES = ("engine", "sparse_tables", "models", "streaming", "hdfs_io")

#: package -> packages it never imports (DESIGN.md's "never imports" column)
FORBIDDEN = {
    "sparse_tables": {"engine", "models", "streaming"},
    "models": {"engine"},
    "streaming": {"engine", "models"},
    "hdfs_io": {"engine", "models"},
    "engine": set(),
}

LOWER = tuple(p for p in PACKAGES if p != "engine")


@dataclass(frozen=True)
class Import:
    """One edge: ``src`` imports ``dst`` at ``path:line``; ``how`` says why when it is not a plain
    import statement (``"runs the package __init__"``, ``"dynamic import"``)."""

    src: str
    dst: str
    path: str
    line: int
    how: str = ""

    def where(self) -> str:
        return f"{self.path}:{self.line}" + (f", {self.how}" if self.how else "")


# ------------------------------------------------------------------------------------ collection
def module_files(root: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name -> file (a package is its ``__init__``)."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve_base(module: str, is_package: bool, level: int, name: str | None) -> str:
    """Absolute module named by ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    pkg = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(pkg) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package (level {level})")
    base = pkg[:len(pkg) - (level - 1)]
    return ".".join(base + ([name] if name else []))


_DYNAMIC = {"import_module", "__import__"}
RUNS_INIT = "runs the package __init__"


def _calls_dynamic_import(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _DYNAMIC:
                return True
    return False


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Edges from ``module`` (file ``path``) to modules in ``known``: every import statement in the
    file, wherever it sits, the package ``__init__``s it runs, and its dynamic imports (module
    docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    out = []

    def add(dst: str, line: int, how: str = "") -> None:
        if dst not in known:
            return
        out.append(Import(module, dst, rel, line, how))
        parts = dst.split(".")
        for i in range(1, len(parts)):
            anc = ".".join(parts[:i])
            if anc in known and module != anc and not module.startswith(anc + "."):
                out.append(Import(module, anc, rel, line, RUNS_INIT))

    dynamic = _calls_dynamic_import(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_base(module, is_package, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                add(sub if a.name != "*" and sub in known else base, node.lineno)
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in known and node.value != module:
            add(node.value, node.lineno, "dynamic import")
    return out


def import_edges(root: Path = REPO, packages=PACKAGES) -> list[Import]:
    """All edges between modules of ``packages``."""
    files = module_files(root, packages)
    known = set(files)
    return [e for m, f in files.items() for e in imports_of(m, f, known)]


# ------------------------------------------------------------------------------------ cycles
def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in a stable order.

    Parameters
    ----------
    graph : dict str -> set of str
        Node -> successors; successors missing as keys are nodes without edges.
    """
    nodes = sorted(set(graph) | {v for vs in graph.values() for v in vs})
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    u = work[-1][0]
                    low[u] = min(low[u], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    out.append(sorted(comp))
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The components that are cycles: more than one node, or one node with an edge to itself."""
    return [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph.get(c[0], ())]


def one_loop(graph: dict[str, set[str]], component: list[str], start: str | None = None) -> list[str]:
    """A shortest closed path ``[start, ..., start]`` inside ``component`` (breadth-first); ``start``
    defaults to the component's first node."""
    members = set(component)
    start = component[0] if start is None else start
    prev, queue = {}, deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in members:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if v != start else [start, start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    raise ValueError(f"{component} is not a cycle")


def loops(graph: dict[str, set[str]], component: list[str]) -> list[list[str]]:
    """Distinct shortest loops through each module of ``component``, shortest first: one component
    often merges several independent loops, and each needs its own fix."""
    seen, out = set(), []
    for node in component:
        loop = one_loop(graph, component, node)
        ring = loop[:-1]
        k = ring.index(min(ring))
        key = tuple(ring[k:] + ring[:k])
        if key not in seen:
            seen.add(key)
            out.append(list(key) + [key[0]])
    return sorted(out, key=lambda l: (len(l), l))


def describe_cycles(edges: list[Import], max_loops: int = 12) -> list[str]:
    """One message per cycle of the graph of ``edges``: its modules, then its distinct shortest loops
    with the file:line of every step."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        where.setdefault((e.src, e.dst), e.where())
    msgs = []
    for comp in cycles(graph):
        found = loops(graph, comp)
        lines = [f"cycle of {len(comp)} modules {comp}; {len(found)} distinct shortest loop(s):"]
        for loop in found[:max_loops]:
            lines.append("    " + " -> ".join(loop))
            lines.extend(f"        {a} -> {b}  ({where[a, b]})" for a, b in zip(loop, loop[1:]))
        if len(found) > max_loops:
            lines.append(f"    ... and {len(found) - max_loops} more")
        msgs.append("\n".join(lines))
    return msgs


# ------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return import_edges()


def _package(module: str) -> str:
    return module.split(".", 1)[0]


def _is_private(module: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in module.split("."))


def test_the_walk_sees_the_tree(edges):
    """Guards the guard: every package is found and deferred imports inside functions are collected."""
    files = module_files()
    assert {_package(m) for m in files} == set(PACKAGES)
    assert len(files) > 50, f"only {len(files)} modules found under {REPO}"
    # models' word2vec kernels use sparse_tables' SplitMix64 (module level), and the export CLI opens
    # its source with a deferred import inside a function
    assert any(e.src == "models._w2v_kernels" and _package(e.dst) == "sparse_tables" for e in edges)
    assert any(e.src == "engine.export.cli" and e.dst == "engine.export.source" for e in edges)


def test_no_package_imports_a_room_above_it(edges):
    bad = [f"{e.where()}: {e.src} imports {e.dst} ({_package(e.src)} never imports {_package(e.dst)})"
           for e in edges if e.how != RUNS_INIT and _package(e.dst) in FORBIDDEN[_package(e.src)]]
    assert not bad, "layering broken (DESIGN.md, the rooms of the house):\n" + "\n".join(bad)


def test_lower_packages_import_only_public_modules_of_other_packages(edges):
    bad = [f"{e.where()}: {e.src} imports {e.dst}, a private module of {_package(e.dst)}"
           for e in edges if e.how != RUNS_INIT
           and _package(e.src) in LOWER and _package(e.dst) != _package(e.src) and _is_private(e.dst)]
    assert not bad, ("a package reaches into another's private module; expose what it needs through a "
                     "public, documented module of the owner:\n" + "\n".join(bad))


def test_no_import_cycles(edges):
    msgs = describe_cycles(edges)
    assert not msgs, ("import cycles (move the shared piece into a module both import):\n"
                      + "\n".join(msgs))


# ------------------------------------------------------------------------------------ self-tests
def test_cycle_detector_on_a_synthetic_graph():
    graph = {
        "a": {"b"}, "b": {"c"}, "c": {"a", "d"},     # a -> b -> c -> a
        "d": {"e"}, "e": {"f"}, "f": set(),           # a chain hanging off the cycle: no cycle
        "g": {"g"},                                   # a self-import
        "h": {"i"}, "i": {"h", "j"}, "j": {"k"}, "k": {"j"},   # two 2-cycles joined one way
        "x": {"y", "z"}, "y": {"z"},                  # a diamond: no cycle
    }
    assert cycles(graph) == [["a", "b", "c"], ["g"], ["h", "i"], ["j", "k"]]
    assert one_loop(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert one_loop(graph, ["g"]) == ["g", "g"]
    assert one_loop(graph, ["a", "b", "c"], "c") == ["c", "a", "b", "c"]
    # two loops sharing a node form one component; both are listed
    figure8 = {"m": {"p", "q"}, "p": {"m"}, "q": {"m"}}
    assert cycles(figure8) == [["m", "p", "q"]]
    assert loops(figure8, ["m", "p", "q"]) == [["m", "p", "m"], ["m", "q", "m"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # deep chains do not hit the recursion limit
    n = 5000
    chain = {str(i): {str(i + 1)} for i in range(n)}
    assert cycles(chain) == []
    chain[str(n)] = {"0"}
    assert len(cycles(chain)[0]) == n + 1


def test_cycles_are_reported_with_files_and_lines():
    e = [Import("p.a", "p.b", "p/a.py", 3), Import("p.b", "p.a", "p/b.py", 7), Import("p.b", "q", "p/b.py", 8)]
    (msg,) = describe_cycles(e)
    assert "['p.a', 'p.b']" in msg and "p.a -> p.b  (p/a.py:3)" in msg and "p.b -> p.a  (p/b.py:7)" in msg


def test_imports_are_resolved_like_python_does(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c, VALUE\nimport pkg.sub\n"
                              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import T\n")
    (pkg / "b.py").write_text("def g():\n    from .sub.c import h\n    import numpy\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\nfrom ._p import x\n")
    (pkg / "sub" / "c.py").write_text("from ..b import g\n")
    (pkg / "sub" / "_p.py").write_text("")
    (pkg / "reg.py").write_text('import importlib\nNAMES = {"x": "pkg.sub.c", "y": "pkg.reg", "z": "numpy"}\n'
                                'def load(k):\n    return importlib.import_module(NAMES[k])\n')
    (pkg / "log.py").write_text('import logging\nlog = logging.getLogger("pkg.sub")\n')
    files = module_files(tmp_path, ("pkg",))
    known = set(files)
    got = sorted((e.src, e.dst, e.how) for m, f in files.items() for e in imports_of(m, f, known))
    init, dyn = RUNS_INIT, "dynamic import"
    assert got == sorted([
        ("pkg", "pkg.a", ""),
        ("pkg.a", "pkg.b", ""),
        ("pkg.a", "pkg.sub.c", ""), ("pkg.a", "pkg.sub", init),   # from .sub import c runs sub's __init__
        ("pkg.a", "pkg.sub", ""),                                  # ... and VALUE is a name of pkg.sub
        ("pkg.a", "pkg.sub", ""),                                  # import pkg.sub (pkg's __init__ already ran)
        ("pkg.a", "pkg.b", ""),                                    # the TYPE_CHECKING import counts
        ("pkg.b", "pkg.sub.c", ""), ("pkg.b", "pkg.sub", init),   # an import inside a function counts
        ("pkg.sub", "pkg.a", ""), ("pkg.sub", "pkg.sub._p", ""),
        ("pkg.sub.c", "pkg.b", ""),
        ("pkg.reg", "pkg.sub.c", dyn), ("pkg.reg", "pkg.sub", init),   # a registry of module names
        # pkg.log: a string naming a module is no import where nothing imports by name
    ])
    assert _is_private("pkg.sub._p") and not _is_private("pkg.sub") and not _is_private("pkg.__main__")
