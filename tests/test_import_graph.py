"""The import graph of tkit, read statically (issue #19).

Every module of the package is parsed with ast and every import in it counted, at the top
level and inside functions alike (a lazy import is still an arrow). Two rules:

* no cycle among the tkit.kernels modules;
* arrows point down: nothing in tkit.kernels imports tkit.ir_tools, tkit.cuda_ext, tkit.bench,
  tkit.specs, tkit.registry, tkit.cli or tkit.models (a higher layer registers a hook with a
  lower one).

An import of ``a.b.c`` is an arrow to ``a.b.c`` only, not to the packages above it that Python
also initializes: a package's ``__init__`` imports its rooms, and a room importing a sibling
is not a cycle through the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tkit"
UP = ("tkit.ir_tools", "tkit.cuda_ext", "tkit.bench", "tkit.specs", "tkit.registry", "tkit.cli",
      "tkit.models")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported tkit module, line) for every import statement in the module ``name``."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if sub in known else mod, node.lineno))
    return [(m, line) for m, line in out if m == "tkit" or m.startswith("tkit.")]


def graph(root: Path = ROOT) -> dict[str, list[tuple[str, int]]]:
    mods = _modules(root)
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (or a self-loop)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return comps


def kernel_cycles(g) -> list[list[str]]:
    edges = {m: {t for t, _ in imps if t.startswith("tkit.kernels") and t != m}
             for m, imps in g.items() if m.startswith("tkit.kernels")}
    return _cycles(edges)


def upward_imports(g) -> list[str]:
    return [f"{m}:{line} imports {t}" for m, imps in sorted(g.items())
            if m.startswith("tkit.kernels") for t, line in imps
            if any(t == u or t.startswith(u + ".") for u in UP)]


def test_the_graph_is_read():
    g = graph()
    assert "tkit.kernels.attention" in g and "tkit.kernels._common" in g
    # a function-level import is counted: the lazy import of the Gluon module
    assert any(t == "tkit.kernels.attention.hopper" for t, _ in g["tkit.kernels.attention.ops"])


def test_no_cycle_among_kernel_modules():
    cycles = kernel_cycles(graph())
    assert not cycles, "import cycles among tkit.kernels modules: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_kernels_import_nothing_above_them():
    bad = upward_imports(graph())
    assert not bad, "tkit.kernels imports a higher layer:\n" + "\n".join(bad)


@pytest.mark.parametrize("bad", ["cycle", "up"])
def test_the_checks_can_fail(tmp_path, bad):
    """The same checks on a copy of a small fake package with the violation planted."""
    pkg = tmp_path / "tkit"
    (pkg / "kernels" / "fam").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "registry.py").write_text("")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "_common.py").write_text("import torch\n")
    (pkg / "kernels" / "fam" / "__init__.py").write_text(
        "from tkit.kernels.fam import ops\n")
    if bad == "cycle":
        (pkg / "kernels" / "fam" / "ops.py").write_text(
            "def f():\n    from . import config\n")
        (pkg / "kernels" / "fam" / "config.py").write_text(
            "from tkit.kernels.fam.ops import f\n")
        cycles = kernel_cycles(graph(pkg))
        assert cycles == [["tkit.kernels.fam.config", "tkit.kernels.fam.ops"]]
    else:
        (pkg / "kernels" / "fam" / "ops.py").write_text(
            "def cost():\n    from tkit.registry import Cost\n")
        assert upward_imports(graph(pkg)) == [
            "tkit.kernels.fam.ops:2 imports tkit.registry"]
