"""The model's length limit and its own tokens: what every workload length is a fraction of."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from transformers import AutoTokenizer

from fallbackgate.engine.config import EngineConfig

#: The engine's default `max_model_len` (prompt + output tokens per request).
DEFAULT_MAX_MODEL_LEN: int = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_model_len")


@dataclasses.dataclass(frozen=True, slots=True)
class LengthLimit:
    """Tokens per request (prompt + output) the engine accepts: ``min(max_model_len, max_position_embeddings)``."""

    max_model_len: int
    max_position_embeddings: int | None  # None: the config names none

    @property
    def tokens(self) -> int:
        """The limit itself."""
        return min(self.max_model_len, self.max_position_embeddings or self.max_model_len)

    def describe(self) -> str:
        """One line: the limit and where it comes from."""
        positions = self.max_position_embeddings if self.max_position_embeddings is not None else "none"
        return f"{self.tokens} tokens = min(max_model_len {self.max_model_len}, max_position_embeddings {positions})"


def length_limit(model_dir: str | pathlib.Path, max_model_len: int | None = None) -> LengthLimit:
    """The limit for the checkpoint in `model_dir` (its config.json) under `max_model_len` (default: the
    engine's); a ValueError when there is no readable config."""
    config_path = pathlib.Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"no readable config.json ({exc.__class__.__name__})") from None
    positions = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if positions is not None and (not isinstance(positions, int) or positions < 1):
        raise ValueError(f"config.json: max_position_embeddings must be a positive integer, got {positions!r}")
    return LengthLimit(max_model_len or DEFAULT_MAX_MODEL_LEN, positions)


class ModelTokens:
    """The checkpoint's tokenizer, used the way the engine uses it (``tokenizer.encode(prompt)``)."""

    def __init__(self, model_dir: str | pathlib.Path) -> None:
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"no tokenizer ({str(exc).splitlines()[0][:160]})") from None
        self.tokenizer.model_max_length = 1 << 62  # whole documents are counted before they are cut to length

    def ids(self, prompt: str) -> list[int]:
        """The prompt's token ids as the engine sees them (special tokens included)."""
        return list(self.tokenizer.encode(prompt))

    def count(self, prompt: str) -> int:
        """The prompt's length in the engine's tokens."""
        return len(self.ids(prompt))

    def count_plain(self, text: str) -> int:
        """Tokens of a piece of text inside a prompt (no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def head(self, text: str, max_tokens: int) -> str:
        """The longest start of `text`, cut after a whole word, with at most `max_tokens` plain tokens."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            return text
        for budget in range(max_tokens, 0, -1):
            cut = self.tokenizer.decode(ids[:budget], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            cut = cut.rstrip("\ufffd")
            if text.startswith(cut) and not text[len(cut) : len(cut) + 1].isspace():  # inside a word: drop it
                cut = cut[: max(0, cut.rfind(" "))]
            cut = cut.rstrip()
            if self.count_plain(cut) <= max_tokens:
                return cut
        return ""
