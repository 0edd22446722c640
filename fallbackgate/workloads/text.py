"""Where workload text comes from: the bundled evaluation passages, plus the shared book corpus when present.

The bundled passages (``evals/data/*.jsonl``, installed with the package) suffice on their own, so a wheel
install generates every workload; a source checkout also finds the shared corpus (``shared/data/corpus``
beside the checkout or above it, or ``$FALLBACKGATE_CORPUS``). Text is drawn with probability proportional
to each document's length and normalised to single spaces, so pieces join without stray whitespace.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import random

from fallbackgate.resources import package_dir
from fallbackgate.tinymoe.data import clean_text
from fallbackgate.workloads.tokens import ModelTokens

CORPUS_ENV = "FALLBACKGATE_CORPUS"
BUNDLED_FILES = ("rolling_ppl.jsonl", "name_completion.jsonl", "cloze.jsonl")  # passages under `text`/`context`
CHARS_PER_TOKEN_BOUND = 8  # a window of this many characters per wanted token holds enough text


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """One source text."""

    source: str  # "bundled" or "corpus"
    name: str  # the passage id or the book's file stem
    text: str


def bundled_documents() -> list[Document]:
    """The evaluation passages shipped with the package, in file order."""
    data = package_dir("fallbackgate.evals") / "data"
    documents = []
    for file_name in BUNDLED_FILES:
        for line in (data / file_name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                item = json.loads(line)
                documents.append(Document("bundled", item["id"], item.get("text") or item["context"]))
    return documents


def find_corpus() -> pathlib.Path | None:
    """The shared corpus directory: ``$FALLBACKGATE_CORPUS``, else ``shared/data/corpus`` in a folder above a
    source checkout; None when neither holds ``*.txt`` books (a wheel install)."""
    if os.environ.get(CORPUS_ENV):
        return pathlib.Path(os.environ[CORPUS_ENV])
    checkout = pathlib.Path(__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file():
        return None
    for folder in checkout.parents:
        candidate = folder / "shared" / "data" / "corpus"
        if any(candidate.glob("*.txt")):
            return candidate
    return None


def corpus_documents(corpus_dir: pathlib.Path) -> list[Document]:
    """The books of `corpus_dir`, cleaned as for training; a ValueError when it holds none."""
    paths = sorted(corpus_dir.glob("*.txt")) if corpus_dir.is_dir() else []
    if not paths:
        raise ValueError("no *.txt books there")
    return [Document("corpus", p.stem, clean_text(p.read_text(encoding="utf-8", errors="replace"))) for p in paths]


class TextPool:
    """Seeded draws of text by length in the model's tokens."""

    def __init__(self, tokens: ModelTokens, documents: list[Document], sources: list[str]) -> None:
        if not documents:
            raise ValueError("no documents to draw text from")
        self.tokens = tokens
        self.documents = documents
        self.sources = sources  # what the documents are, for the summary
        self._cumulative = list(itertools.accumulate(len(d.text) for d in documents))

    @classmethod
    def load(cls, tokens: ModelTokens, corpus_dir: pathlib.Path | None) -> TextPool:
        """The bundled passages, plus the books of `corpus_dir` when given."""
        documents = bundled_documents()
        sources = [f"bundled: {len(documents)} passages of {', '.join(BUNDLED_FILES)}"]
        if corpus_dir is not None:
            books = corpus_documents(corpus_dir)
            documents += books
            sources.append(f"corpus: {len(books)} books in {corpus_dir}")
        return cls(tokens, documents, sources)

    def pieces(self, rng: random.Random, num_tokens: int) -> list[str]:
        """Pieces of text from documents drawn at random, together at least `num_tokens` plain tokens."""
        pieces: list[str] = []
        total = 0
        while total < num_tokens:
            piece = self._piece(rng, num_tokens - total)
            if piece:
                pieces.append(piece)
                total += self.tokens.count_plain(piece)
        return pieces

    def passage(self, rng: random.Random, num_tokens: int) -> str:
        """Running text of at most `num_tokens` plain tokens (fewer only by a cut word)."""
        return self.tokens.head(" ".join(self.pieces(rng, num_tokens)), num_tokens)

    def _piece(self, rng: random.Random, num_tokens: int) -> str:
        document = rng.choices(self.documents, cum_weights=self._cumulative)[0]
        text, width = document.text, num_tokens * CHARS_PER_TOKEN_BOUND + 16
        start = 0
        if len(text) > width:  # a long document: from a random sentence start (else word start)
            start = rng.randrange(len(text) - width)
            sentence_end = text.find(". ", start, start + width // 2)
            start = sentence_end + 1 if sentence_end >= 0 else start
            while start < len(text) and not text[start].isspace():
                start += 1
        window = text[start : start + width]
        if start + width < len(text):  # cut inside the document: drop the partial last word
            window = window[: max(0, window.rfind(" "), window.rfind("\n"))]
        return self.tokens.head(" ".join(window.split()), num_tokens)
