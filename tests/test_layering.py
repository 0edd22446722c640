"""The package's layering as DESIGN.md states it, checked on the imports themselves (static, via ast).

Every import counts: at module level, inside functions, and under ``if TYPE_CHECKING:``.

- every file imports its siblings under the one import name ``fallbackgate`` (no top-level ``engine`` & co.);
- dependencies point down the layers of :data:`LAYERS`: a module imports its own package and packages of
  lower layers only (never a package of its own layer); the dashboard reads the ledger only;
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

# Top first. A package is named relative to ``fallbackgate.``; the longest name that prefixes a module is its
# package ("" is the top-level ``fallbackgate/__init__.py``). Packages that DESIGN.md does not place sit where
# what they import puts them.
LAYERS: list[tuple[str, ...]] = [
    ("__main__",),
    ("cli",),
    ("commands", "bench"),  # the command line and the benchmarks
    ("evals", "sweep"),  # lm-eval, the sweep (which draws its requests from workloads)
    ("workloads",),  # workload files: use batch's prompts and settings
    ("assembly",),  # policy + overrides -> engine, controller, settings, recorder (imported by the above)
    ("api_server",),  # the HTTP server
    ("recording",),  # the run recorder (serves a batch through batch's session)
    ("batch",),  # batch runs: prompt files, serving prompts, what a run prints
    ("audit", "planning", "tracing"),  # audit and gate; plans (from the cost model); joint traces and analyses
    ("controllers",),
    ("policy",),
    ("profiling", "synth"),  # the measured hardware profile; the synthetic-checkpoint tool
    ("ledger", ""),  # the ledger; the top-level re-exports of the engine's vocabulary
    ("tinymoe",),  # the bundled checkpoint
    ("resources",),  # package data lookup
    ("engine",),  # imports nothing outside itself
]
DASHBOARD = "dashboard"  # reads the ledger only; imported by the top layer only
RANK = {package: len(LAYERS) - i for i, layer in enumerate(LAYERS) for package in layer}


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


def _imports(path: pathlib.Path) -> set[str]:
    return _imports_of_text(path.read_text())


def _imports_of_text(source: str) -> set[str]:
    """Every name an import statement of the source names, wherever it stands (TYPE_CHECKING included)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _package(module: str) -> str:
    name = module.removeprefix("fallbackgate").removeprefix(".")
    known = [p for p in (*RANK, DASHBOARD) if p == "" or name == p or name.startswith(p + ".")]
    return max(known, key=len)


MODULES = _module_files()
GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def test_the_tree_is_found() -> None:
    assert {"fallbackgate.engine.engine", "fallbackgate.ledger.db", "fallbackgate.audit.gate"} <= set(MODULES)
    assert len(MODULES) > 100


def test_every_folder_has_a_layer() -> None:
    folders = {p.name for p in (ROOT / "fallbackgate").iterdir() if (p / "__init__.py").is_file()}
    assert folders - {p for p in RANK if "." not in p} - {DASHBOARD} == set()


def _may_import(module: str, target: str) -> bool:
    source, other = _package(module), _package(target)
    if source == other:
        return True
    if source == DASHBOARD:
        return other == "ledger"
    if other == DASHBOARD:
        return RANK[source] >= RANK["commands"]
    return RANK[other] < RANK[source]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_use_the_one_name_and_point_down(module: str) -> None:
    imported = _imports(MODULES[module])
    stray = {i for i in imported if i.split(".")[0] in ("engine", "ledger", "evals", "dashboard")}
    assert not stray, f"{module} imports top-level {sorted(stray)}"
    for target in GRAPH[module]:
        assert _may_import(module, target), f"{module} ({_package(module)}) imports {target} ({_package(target)})"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
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


def test_the_cycle_check_sees_type_checking_imports() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fallbackgate.engine.engine import Engine\n"
    assert "fallbackgate.engine.engine" in _imports_of_text(source)


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
