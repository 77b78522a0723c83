"""The shape of the source tree: no import cycles between the modules of src/addnorm, no file past one reader's span.

The import graph is built statically from the files (every `import` and `from ... import`, at module level or inside
a function: a lazy import still ties two modules together). `from package import name` points at the submodule
`package.name` when that file exists, else at the package's `__init__.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "addnorm"
MAX_LINES = 500


def _module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/PACKAGE."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific existing module that `import name` runs (None outside the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    modules = _module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        package = mod if is_package else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y / from .. import z
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t == PACKAGE or t.startswith(PACKAGE + "."):
                    dep = _resolve(t, modules)
                    if dep is not None and dep != mod:
                        graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
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
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles_in_src():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_train_imports_nothing_from_the_lab():
    """The lab runs training, never the other way round: what both need (the output lock) lives below both."""
    graph = import_graph()
    up = sorted(
        f"{mod} -> {dep}"
        for mod, deps in graph.items()
        if mod.startswith(f"{PACKAGE}.train")
        for dep in deps
        if dep.startswith(f"{PACKAGE}.lab")
    )
    assert not up, "addnorm.train imports the lab:\n" + "\n".join(up)


def test_no_source_file_past_one_readers_span():
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / PACKAGE).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "src"


@pytest.mark.parametrize(
    "files, expected",
    [
        # a lazy import inside a function still closes a loop
        (
            {
                "addnorm/__init__.py": "",
                "addnorm/a.py": "from addnorm.b import f\n",
                "addnorm/b.py": "def f():\n    from addnorm import a\n",
            },
            [["addnorm.a", "addnorm.b"]],
        ),
        # relative imports, three modules round
        (
            {
                "addnorm/__init__.py": "",
                "addnorm/p/__init__.py": "",
                "addnorm/p/x.py": "from .y import g\n",
                "addnorm/p/y.py": "from ..z import h\n",
                "addnorm/z.py": "import addnorm.p.x\n",
            },
            [["addnorm.p.x", "addnorm.p.y", "addnorm.z"]],
        ),
        # a package's __init__ importing its submodules, which import siblings by absolute path: no cycle
        (
            {
                "addnorm/__init__.py": "",
                "addnorm/p/__init__.py": "from addnorm.p.x import g\n",
                "addnorm/p/x.py": "from addnorm.p.y import h\n",
                "addnorm/p/y.py": "import torch\n",
            },
            [],
        ),
    ],
)
def test_the_cycle_finder_sees_what_it_should(tmp_path, files, expected):
    assert cycles(import_graph(_write(tmp_path, files))) == expected


def test_nothing_under_ops_imports_the_oracle():
    """The float oracle (addnorm.reference) judges the kernels: a kernel that imported it could share its mistakes,
    and the runtime path would carry the oracle. What both need (the dropout hash, the row mean) is the contract,
    addnorm.ops.contract, which the oracle imports instead. The `reference` backend, which runs the oracle behind
    the kernel contract, lives outside ops/ (addnorm.reference_backend) and the registry names it by its import
    path, so no module under ops/ is an exception."""
    graph = import_graph()
    taken = sorted(m for m, deps in graph.items() if m.startswith(f"{PACKAGE}.ops") and f"{PACKAGE}.reference" in deps)
    assert not taken, f"modules under {PACKAGE}.ops importing {PACKAGE}.reference: {taken}"
