"""Corpus access and the train / held-out split for the tiny MoE model.

Whole books are held out: they are never used to train the tokenizer or the
model, and every evaluation item is drawn from them.
"""

from __future__ import annotations

import os
import pathlib
import re

#: Books (file stems in the corpus directory) never used for training.
HELDOUT_BOOKS: tuple[str, ...] = (
    "the_railway_children",
    "the_princess_and_the_goblin",
    "little_lord_fauntleroy",
)

EOS_TOKEN = "<|endoftext|>"


def default_corpus_dir() -> pathlib.Path:
    """Return the corpus directory (``$FALLBACKGATE_CORPUS`` or ``../shared/data/corpus``)."""
    env = os.environ.get("FALLBACKGATE_CORPUS")
    if env:
        return pathlib.Path(env)
    repo_root = pathlib.Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "data" / "corpus"


_START_RE = re.compile(r"\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*?\*\*\*", re.IGNORECASE | re.DOTALL)
_END_RE = re.compile(r"(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.IGNORECASE)


def clean_text(text: str) -> str:
    """Strip Project Gutenberg header/footer (if any) and normalise whitespace."""
    match = _START_RE.search(text)
    if match:
        text = text[match.end():]
    match = _END_RE.search(text)
    if match:
        text = text[: match.start()]
    text = text.replace("\r\n", "\n").replace("\ufeff", "")
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip() + "\n"


def load_books(corpus_dir: pathlib.Path | None = None) -> dict[str, str]:
    """Load and clean every ``*.txt`` book in the corpus, keyed by file stem."""
    corpus_dir = corpus_dir or default_corpus_dir()
    paths = sorted(corpus_dir.glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no *.txt books found in {corpus_dir}")
    return {p.stem: clean_text(p.read_text(encoding="utf-8")) for p in paths}


def split_books(books: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Split books into (train, held-out) dictionaries by :data:`HELDOUT_BOOKS`."""
    missing = [b for b in HELDOUT_BOOKS if b not in books]
    if missing:
        raise KeyError(f"held-out books missing from corpus: {missing}")
    train = {k: v for k, v in books.items() if k not in HELDOUT_BOOKS}
    heldout = {k: books[k] for k in HELDOUT_BOOKS}
    return train, heldout
