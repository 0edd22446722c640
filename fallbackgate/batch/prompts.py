"""Prompts files (JSONL) and the built-in prompts used when none is given."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Collection

BUILTIN_PROMPTS: tuple[str, ...] = (
    "Once upon a time there was a little girl who lived in a cottage at the edge of a great forest.",
    "The king called his three sons to him and said,",
    "It was a cold winter morning, and the snow lay deep upon the ground.",
    '"Where are you going?" asked the old woman, looking up from her spinning.',
    "Anne looked out of the window at the orchard, where the cherry trees were in bloom.",
    "The children ran down to the railway to watch the trains go by.",
)


@dataclasses.dataclass(slots=True, frozen=True)
class PromptSpec:
    """One request from a prompts file."""

    prompt: str  # the text
    request_id: str  # `id`, or prompt-<line number>
    request_class: str = "default"  # `class`: the policy request class
    max_new_tokens: int | None = None  # overrides --max-new-tokens
    arrival_s: float | None = None  # `arrival_s`: seconds from the start of the workload (None: at once)
    session: str | None = None  # `session`: the multi-turn session the request is a turn of
    turn: int | None = None  # `turn`: its turn in the session, from 0


MAX_ID_CHARS = 128  # requests.request_id is VARCHAR(128)
MAX_CLASS_CHARS = 64  # requests.request_class is VARCHAR(64)


class PromptsFileError(ValueError):
    """A prompts file that cannot be used; the message names the file, line and field."""


def load_prompts(path: str | pathlib.Path | None) -> list[PromptSpec]:
    """Read a JSONL prompts file: one object per line with `prompt` and optional `id`, `class`, `max_new_tokens`,
    `arrival_s` and, for a turn of a multi-turn session, `session` and `turn` (both or neither)."""
    if path is None:
        return [PromptSpec(text, f"builtin-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]
    path = pathlib.Path(path)
    if path.is_dir():
        raise PromptsFileError(f"prompts file {path} is a directory, not a JSONL file")
    if not path.is_file():
        raise PromptsFileError(f"prompts file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise PromptsFileError(
            f"prompts file {path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x})"
        ) from None
    except OSError as exc:
        raise PromptsFileError(f"prompts file {path} cannot be read ({exc.strerror})") from None
    specs: list[PromptSpec] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        spec = _parse_line(path, number, line, seen)
        arrival_s, session, turn = _parse_timing(f"{path}:{number}", json.loads(line))
        specs.append(dataclasses.replace(spec, arrival_s=arrival_s, session=session, turn=turn))
    if not specs:
        raise PromptsFileError(f"{path}: no prompts (expected one JSON object per line)")
    return specs


def _parse_timing(where: str, item: dict) -> tuple[float | None, str | None, int | None]:
    """The optional `arrival_s`, `session` and `turn` of a line (`fallbackgate workload` writes them)."""
    arrival = item.get("arrival_s")
    if arrival is not None and (
        not isinstance(arrival, int | float) or isinstance(arrival, bool) or not 0 <= arrival < float("inf")
    ):
        raise PromptsFileError(f"{where}: field 'arrival_s' must be a finite number of seconds >= 0, got {arrival!r}")
    session, turn = item.get("session"), item.get("turn")
    if (session is None) != (turn is None):
        given = "turn" if session is None else "session"
        raise PromptsFileError(f"{where}: fields 'session' and 'turn' go together, got only {given!r}")
    if session is not None and (not isinstance(session, str) or not 1 <= len(session) <= MAX_ID_CHARS):
        raise PromptsFileError(
            f"{where}: field 'session' must be a string of 1..{MAX_ID_CHARS} characters, got {str(session)[:80]!r}"
        )
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 0):
        raise PromptsFileError(f"{where}: field 'turn' must be an integer >= 0, got {turn!r}")
    return (None if arrival is None else float(arrival)), session, turn


def _parse_line(path: pathlib.Path, number: int, line: str, seen: set[str]) -> PromptSpec:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptsFileError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(item, dict):
        raise PromptsFileError(f"{where}: expected a JSON object, got {type(item).__name__}")
    unknown = set(item) - {"prompt", "id", "class", "max_new_tokens", "arrival_s", "session", "turn"}
    if unknown:
        raise PromptsFileError(f"{where}: unknown field(s) {sorted(unknown)}")
    prompt = item.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptsFileError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r}")
    request_id = str(item.get("id", f"prompt-{number}"))
    if not 1 <= len(request_id) <= MAX_ID_CHARS:  # the ledger's limit, on every backend
        raise PromptsFileError(f"{where}: field 'id' must be 1..{MAX_ID_CHARS} characters, got {len(request_id)}")
    if request_id in seen:
        raise PromptsFileError(f"{where}: field 'id' value {request_id!r} is used twice")
    seen.add(request_id)
    request_class = item.get("class", "default")
    if not isinstance(request_class, str) or not 1 <= len(request_class) <= MAX_CLASS_CHARS:
        raise PromptsFileError(
            f"{where}: field 'class' must be a string of 1..{MAX_CLASS_CHARS} characters, "
            f"got {str(request_class)[:80]!r}"
        )
    max_new = item.get("max_new_tokens")
    if max_new is not None and (not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1):
        raise PromptsFileError(f"{where}: field 'max_new_tokens' must be a positive integer, got {max_new!r}")
    return PromptSpec(prompt, request_id, request_class, max_new)


def check_classes(specs: list[PromptSpec], classes: Collection[str], default: str) -> list[PromptSpec]:
    """Requests name their class in the prompts file; "default" maps to the policy's `default` class and every
    class must be one of `classes`."""
    out = []
    for spec in specs:
        name = default if spec.request_class == "default" else spec.request_class
        if name not in classes:
            raise PromptsFileError(
                f"request {spec.request_id!r}: class {spec.request_class!r} is not in the policy "
                f"(classes: {sorted(classes)})"
            )
        out.append(dataclasses.replace(spec, request_class=name))
    return out
