"""The package's layering as the README states it, checked on the imports themselves (static, via ast).

- every file imports its siblings under the one import name ``fallbackgate`` (no top-level ``engine`` & co.);
- dependencies point down: evals -> fallbackgate -> ledger -> engine, dashboard -> ledger; only the top
  (the CLI: ``fallbackgate.commands``, ``fallbackgate.cli``; benchmarks: ``fallbackgate.bench``) may import
  ``fallbackgate.evals``;
- no two files import each other, directly or through a cycle.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"engine": "fallbackgate.engine", "ledger": "fallbackgate.ledger", "evals": "fallbackgate.evals"}
FOLDERS |= {"dashboard": "fallbackgate.dashboard", "fallbackgate": "fallbackgate"}
# layer -> the layers its files may import (besides their own)
ALLOWED = {
    "fallbackgate.engine": set(),
    "fallbackgate.ledger": {"fallbackgate.engine"},
    "fallbackgate.dashboard": {"fallbackgate.ledger"},
    "fallbackgate": {"fallbackgate.ledger", "fallbackgate.engine"},
    "fallbackgate.cli": {"fallbackgate", "fallbackgate.ledger", "fallbackgate.engine", "fallbackgate.evals"}
    | {"fallbackgate.dashboard"},
    "fallbackgate.evals": {"fallbackgate", "fallbackgate.ledger", "fallbackgate.engine"},
}


def _module_files() -> dict[str, pathlib.Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "migrations" in path.parts or "data" in path.relative_to(ROOT / folder).parts[:-1]:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never imported at run time)."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _layer(module: str) -> str:
    if module.startswith(("fallbackgate.commands", "fallbackgate.cli", "fallbackgate.bench", "fallbackgate.__main__")):
        return "fallbackgate.cli"
    for sub in ("engine", "ledger", "evals", "dashboard"):
        if module == f"fallbackgate.{sub}" or module.startswith(f"fallbackgate.{sub}."):
            return f"fallbackgate.{sub}"
    return "fallbackgate"


MODULES = _module_files()
GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_the_tree_is_found() -> None:
    assert {"fallbackgate.engine.engine", "fallbackgate.ledger.db", "fallbackgate.audit.gate"} <= set(MODULES)
    assert len(MODULES) > 100


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_use_the_one_name_and_point_down(module: str) -> None:
    imported = _imports(MODULES[module])
    stray = {i for i in imported if i.split(".")[0] in ("engine", "ledger", "evals", "dashboard")}
    assert not stray, f"{module} imports top-level {sorted(stray)}"
    layer = _layer(module)
    for target in GRAPH[module]:
        other = _layer(target)
        assert other == layer or other in ALLOWED[layer], f"{module} ({layer}) imports {target} ({other})"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in GRAPH[node]:
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_only_the_one_name_is_importable_outside_the_checkout(tmp_path: pathlib.Path) -> None:
    code = (
        "import importlib\n"
        "for name in ('engine', 'ledger', 'evals', 'dashboard'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        print(name, 'absent')\n"
        "import fallbackgate.engine.engine, fallbackgate.ledger.db, fallbackgate.evals.task_dir\n"
        "from fallbackgate.resources import package_dir\n"
        "print((package_dir('fallbackgate.dashboard') / 'app.py').is_file())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == [f"{n} absent" for n in ("engine", "ledger", "evals", "dashboard")] + ["True", ""]

