"""Load a policy file: YAML in, a validated :class:`Policy` out, or errors that name the field.

Every error names the field path (``classes.strict.budget.max_mean_kl``), the value found and what
was expected; unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.policy.schema import Policy
from fallbackgate.profiling.store import resolve_profile


class PolicyError(ValueError):
    """A policy that cannot be used; `messages` holds one line per problem, each naming its field."""

    def __init__(self, source: str, messages: list[str]) -> None:
        self.source, self.messages = source, messages
        super().__init__(f"{source}: invalid policy\n" + "\n".join(f"  {m}" for m in messages))


def _path(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _expected(error: dict[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "extra_forbidden":
        return "no such key (unknown keys are errors)"
    if kind == "missing":
        return "a value (the field is required)"
    if kind == "literal_error":
        return f"one of {ctx.get('expected')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        return f"a number {op} {bound}"
    msg = error["msg"].removeprefix("Value error, ")
    return msg[0].lower() + msg[1:]


def format_errors(exc: ValidationError) -> list[str]:
    """One message per pydantic error: `path: got VALUE; expected WHAT`."""
    out = []
    for error in exc.errors(include_url=False):
        loc, value = tuple(error["loc"]), error.get("input")
        msg = error["msg"].removeprefix("Value error, ")
        if error["type"] == "value_error" and msg.startswith("@"):  # a cross-field check names its field
            field, _, expected = msg[1:].partition(": ")
            loc, value = loc + (field,), value.get(field) if isinstance(value, dict) else value
            error = {**error, "msg": expected}
        shown = "(missing)" if error["type"] == "missing" else f"{value!r}"
        if isinstance(value, dict) and error["type"] not in ("extra_forbidden", "dict_type", "model_type"):
            shown = "{...}"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        out.append(f"{_path(loc)}: got {shown}; expected {_expected(error)}")
    return out


def parse_policy(data: Any, source: str = "<policy>") -> Policy:
    """Validate an already-parsed document."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(source, [f"(top level): got {type(data).__name__}; expected a mapping of policy keys"])
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, format_errors(exc)) from None


def load_policy(path: str | pathlib.Path) -> Policy:
    """Read and validate a YAML policy file."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise PolicyError(str(path), ["(file): is a directory, not a policy file"])
    if not path.is_file():
        raise PolicyError(str(path), ["(file): does not exist"])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(
            str(path), [f"(file): not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"]
        ) from None
    except OSError as exc:
        raise PolicyError(str(path), [f"(file): cannot be read ({exc.strerror})"]) from None
    return loads_policy(text, str(path))


def loads_policy(text: str, source: str = "<policy>") -> Policy:
    """Validate YAML text."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        raise PolicyError(source, [f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    return parse_policy(data, source)


def hardware_profile(policy: Policy) -> HardwareProfile:
    """The policy's hardware profile: the named shipped profile with its overrides applied (a disk rate set
    by the policy replaces the measured disk table, so that it is what predictions use)."""
    base = resolve_profile(policy.hardware.profile)
    overrides: dict[str, object] = dict(policy.hardware.overrides())
    if not overrides:
        return base
    if {"disk_to_host_bytes_per_s", "host_to_disk_bytes_per_s"} & set(overrides):
        overrides["disk"] = None
    return dataclasses.replace(base, name=f"{base.name}+policy", **overrides)
