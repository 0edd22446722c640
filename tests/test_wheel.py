"""The wheel holds every package of the tree and every file the code reads at run time, and nothing else.

Everything is derived from the tree (git's list of files, tracked or new and not ignored) and from
``pyproject.toml``'s package-dir mapping: a folder with ``__init__.py`` under a mapped folder is a package;
every other file there is data the wheel must carry, except documentation for readers of the repository
(``NOT_SHIPPED``). The fast tests check ``pyproject.toml`` against the tree; the slow one builds the wheel.
"""

from __future__ import annotations

import fnmatch
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]  # import name -> folder in the tree
FOLDER_PACKAGE = {folder: name for name, folder in PACKAGE_DIR.items()}
# read by people browsing the repository, never by the code
NOT_SHIPPED = ("dashboard/README.md", "dashboard/screenshots/*.png", "*.gitignore")


def _checkout_files() -> list[str]:
    """Every file of the checkout git knows or would add (tracked, or new and not ignored) that exists."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    return sorted({path for path in listed if path and (ROOT / path).is_file()})


def _installed_path(tree_path: str) -> str | None:
    """Where a file of the tree lands in the wheel (None outside the mapped folders)."""
    parts = tree_path.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        package = FOLDER_PACKAGE.get("/".join(parts[:depth]))
        if package is not None:
            return "/".join([*package.split("."), *parts[depth:]])
    return None


CHECKOUT = _checkout_files()
INSTALLED = {path: dest for path in CHECKOUT if (dest := _installed_path(path)) is not None}
SHIPPED = {path: dest for path, dest in INSTALLED.items() if not any(fnmatch.fnmatch(path, p) for p in NOT_SHIPPED)}
PACKAGES = {dest.rsplit("/", 1)[0].replace("/", ".") for dest in INSTALLED.values() if dest.endswith("/__init__.py")}


def _package_of(dest: str) -> str:
    """The deepest package whose folder holds the installed file `dest`."""
    parts = dest.split("/")[:-1]
    while ".".join(parts) not in PACKAGES:
        parts.pop()
    return ".".join(parts)


def _is_module(dest: str) -> bool:
    """A .py file directly in a package: setuptools ships it with the package, without package-data."""
    folder, _, name = dest.rpartition("/")
    return name.endswith(".py") and folder.replace("/", ".") in PACKAGES


def _package_folder(package: str) -> pathlib.Path:
    """The tree folder of `package`, through the package-dir mapping."""
    parts = package.split(".")
    for depth in range(len(parts), 0, -1):
        folder = PACKAGE_DIR.get(".".join(parts[:depth]))
        if folder is not None:
            return ROOT.joinpath(folder, *parts[depth:])
    raise AssertionError(f"{package} is outside the package-dir mapping")


def test_the_tree_is_found() -> None:
    assert set(PACKAGE_DIR) <= PACKAGES
    assert {"fallbackgate.engine.kv", "fallbackgate.synth", "fallbackgate.dashboard.views"} <= PACKAGES
    assert {"fallbackgate/sweep_results/sweep.json", "ledger/migrations/env.py"} <= set(SHIPPED)


def test_the_listed_packages_are_exactly_the_trees_packages() -> None:
    listed = set(SETUPTOOLS["packages"])
    assert not PACKAGES - listed, f"folders with __init__.py missing from pyproject.toml: {sorted(PACKAGES - listed)}"
    assert not listed - PACKAGES, f"listed in pyproject.toml, no such package in the tree: {sorted(listed - PACKAGES)}"


def test_package_data_covers_every_data_file() -> None:
    patterns: dict[str, list[str]] = SETUPTOOLS["package-data"]
    matched: set[pathlib.Path] = set()
    for package, globs in patterns.items():
        folder = _package_folder(package)
        matched |= {path.resolve() for pattern in globs for path in folder.glob(pattern)}
    missing = [
        f"{path} (package {_package_of(dest)})"
        for path, dest in SHIPPED.items()
        if not _is_module(dest) and (ROOT / path).resolve() not in matched
    ]
    assert not missing, f"data files no [tool.setuptools.package-data] pattern ships: {missing}"


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_data_file_and_nothing_else(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "source"  # a clean copy: an old build/ folder in the checkout would leak deleted files
    for path in CHECKOUT:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, source / path)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*cmd, str(source)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("fallbackgate-*.whl")
    names = {n for n in zipfile.ZipFile(wheel).namelist() if not n.split("/")[0].endswith(".dist-info")}
    expected = set(SHIPPED.values())
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert not names - expected, f"in the wheel, not in the tree's shipped files: {sorted(names - expected)}"
