"""docs/ARCHITECTURE.md's layering table is true: every import of the pack's own modules made by a file is allowed
by the row of the table that covers the file (its last column, the backticked module paths), and there is no
import cycle among the pack's modules."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOP = ("models", "optimization", "training", "nodes")
ROW = re.compile(r"^\| `([^`]+)` \|.*\| ([^|]*) \|\s*$")


def table() -> dict[str, list[str] | None]:
    """{row path (dotted, e.g. ``optimization.runtime.knobs`` or ``models.seedvr2``): allowed prefixes, or None for
    "everything"} from the table's rows that name a folder or module of the pack."""
    rows = {}
    for line in (REPO / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        m = ROW.match(line)
        if not m or not m.group(1).split("/")[0] in TOP:
            continue
        path = m.group(1).rstrip("/")
        dotted = path[:-3].replace("/", ".") if path.endswith(".py") else path.replace("/", ".")
        dotted = dotted.removesuffix(".__init__")
        allowed = m.group(2)
        rows[dotted] = None if "everything" in allowed else re.findall(r"`([a-z_][\w.]*)`", allowed)
    return rows


def module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    p = REPO / dotted.replace(".", "/")
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def pack_imports(path: Path) -> set[str]:
    """Dotted pack modules ``path`` imports (relative imports resolved; ``from . import x`` counts as ``pkg.x``)."""
    mod = module_of(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg.split(".")
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:   # ``from .pkg import module`` names the module; ``import name`` the package
                sub = f"{target}.{a.name}"
                out.add(sub if _is_module(sub) else target)
    return {t for t in out if t.split(".")[0] in TOP}


def row_for(mod: str, rows) -> str | None:
    best = None
    for r in rows:
        if (mod == r or mod.startswith(r + ".")) and (best is None or len(r) > len(best)):
            best = r
    return best


def covered(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def product_files():
    for top in TOP:
        yield from sorted((REPO / top).rglob("*.py"))


def test_the_table_names_real_folders():
    rows = table()
    assert len(rows) >= 10, rows
    for r in rows:
        p = REPO / r.replace(".", "/")
        assert p.is_dir() or p.with_suffix(".py").is_file() or (p / "__init__.py").is_file(), r


def test_every_import_is_allowed_by_its_row():
    rows = table()
    bad = []
    for f in product_files():
        mod = module_of(f)
        row = row_for(mod, rows)
        if row is None:
            assert not pack_imports(f), f"{f.relative_to(REPO)} imports the pack but is in no row of the table"
            continue
        allowed = rows[row]
        if allowed is None:
            continue
        own = row if (REPO / row.replace(".", "/")).is_dir() else None
        for t in sorted(pack_imports(f)):
            if own is not None and (t == own or t.startswith(own + ".")):
                continue
            if t == mod or covered(t, allowed):
                continue
            bad.append(f"{f.relative_to(REPO)} imports {t}, which its row ({row}) does not allow: {allowed}")
    assert not bad, "\n".join(bad)


def test_checker_catches_a_forbidden_import(tmp_path, monkeypatch):
    rows = {"optimization.runtime.knobs": [], "optimization": ["models"]}
    assert row_for("optimization.runtime.knobs", rows) == "optimization.runtime.knobs"
    assert not covered("optimization.nvfp4.linear", rows["optimization.runtime.knobs"])
    assert covered("models.seedvr2.pipeline", ["models"]) and not covered("modelsx", ["models"])


def test_no_import_cycle():
    graph = {module_of(f): pack_imports(f) for f in product_files()}
    mods = set(graph)

    def resolve(t):   # ``from .x import name``: the module x, or a package's __init__
        while t and t not in mods:
            t = t.rpartition(".")[0]
        return t
    edges = {m: {resolve(t) for t in ts if resolve(t) and resolve(t) != m} for m, ts in graph.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2
    for m in sorted(edges):
        if m not in state:
            visit(m)
    # a package's __init__ importing its own modules is not a cycle of layers
    real = [c for c in cycles if not all(x == c[0] or x.startswith(c[0] + ".") or c[0].startswith(x + ".")
                                         for x in c)]
    assert not real, "\n".join(" -> ".join(c) for c in real)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
