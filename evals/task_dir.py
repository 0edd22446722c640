"""The local lm-eval tasks: YAML templates in ``evals/tasks/``, rendered with absolute data paths.

The templates name their data as ``__FALLBACKGATE_DATA__/<file>.jsonl``; :func:`render_include_dir` writes
copies with the placeholder replaced by an absolute data directory (the bundled ``evals/data`` by default),
so ``TaskManager(include_path=<rendered dir>, include_defaults=False)`` loads them fully offline from any
working directory, installed or not. :func:`check_tasks` validates task names and data files before any
model work.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Sequence

import yaml

EVALS_DIR = pathlib.Path(__file__).resolve().parent
TEMPLATE_DIR = EVALS_DIR / "tasks"
DATA_DIR = EVALS_DIR / "data"
PLACEHOLDER = "__FALLBACKGATE_DATA__"
LOCAL_TASKS = ("fg_cloze", "fg_rolling_ppl", "fg_names")


class TaskError(ValueError):
    """A task request that cannot run: unknown task name, missing data file, bad task YAML."""


def render_include_dir(
    data_dir: str | pathlib.Path | None = None, dest: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Write the task YAMLs with absolute data paths into `dest` (a new temporary directory when None)."""
    data = pathlib.Path(data_dir or DATA_DIR).resolve()
    out = pathlib.Path(dest) if dest is not None else pathlib.Path(tempfile.mkdtemp(prefix="fallbackgate-tasks-"))
    out.mkdir(parents=True, exist_ok=True)
    for template in sorted(TEMPLATE_DIR.glob("*.yaml")):
        (out / template.name).write_text(template.read_text().replace(PLACEHOLDER, data.as_posix()))
    return out


def _local_yaml(include_dirs: Sequence[pathlib.Path]) -> dict[str, pathlib.Path]:
    """task name -> YAML file, for plain task YAMLs in the include directories."""
    found: dict[str, pathlib.Path] = {}
    for directory in include_dirs:
        for path in sorted(pathlib.Path(directory).rglob("*.yaml")):
            try:
                doc = yaml.load(path.read_text(), Loader=_Lenient)
            except yaml.YAMLError as exc:
                raise TaskError(f"{path}: not valid YAML ({exc})") from None
            if isinstance(doc, dict) and isinstance(doc.get("task"), str):
                found.setdefault(doc["task"], path)
    return found


class _Lenient(yaml.SafeLoader):
    """A safe loader that reads lm-eval's ``!function`` tags as plain strings."""


_Lenient.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _data_files(doc: dict) -> list[str]:
    files = (doc.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for v in files.values() for f in ([v] if isinstance(v, str) else list(v))]
    if isinstance(files, list):
        return [str(f) for f in files]
    return []


def check_tasks(names: Sequence[str], include_dirs: Sequence[str | pathlib.Path]) -> None:
    """Raise :class:`TaskError` naming every unknown task and every missing local data file.

    A name must be a task YAML in `include_dirs` (or, when lm-eval's own tasks are wanted, appear in
    ``TaskManager().all_tasks`` — checked by the caller). Local data files must exist.
    """
    if not names:
        raise TaskError("no tasks given")
    local = _local_yaml([pathlib.Path(d) for d in include_dirs])
    unknown = [n for n in names if n not in local]
    if unknown:
        raise TaskError(f"unknown task(s) {unknown}; available: {sorted(local)}")
    problems = []
    for name in names:
        doc = yaml.load(local[name].read_text(), Loader=_Lenient)
        if doc.get("dataset_path") in ("json", "csv", "parquet", "text"):
            for file in _data_files(doc):
                if "://" not in file and not pathlib.Path(file).is_file():
                    problems.append(f"task {name}: data file {file} does not exist")
    if problems:
        raise TaskError("; ".join(problems))
