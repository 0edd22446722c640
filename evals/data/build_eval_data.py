"""python evals/data/build_eval_data.py [--out evals/data] [--seed 0] [--n 300]

Regenerate the held-out evaluation sets from the books listed in
``fallbackgate.tinymoe.data.HELDOUT_BOOKS`` (never used in training):

* ``rolling_ppl.jsonl``: passages of about 1-2k characters, for rolling
  perplexity;
* ``cloze.jsonl``: a passage and four candidate next sentences (one true,
  three distractors drawn from other held-out passages of similar length),
  hard-wrapped at 70 characters like the books;
* ``name_completion.jsonl``: a passage cut right before a character's name
  that already appeared earlier in the passage; the target is that name.

Field meanings are documented in ``evals/data/README.md``. Output is
deterministic for a given corpus and seed.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import re
import sys
import textwrap

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from fallbackgate.tinymoe.data import load_books, split_books  # noqa: E402

NOT_NAMES = {
    "Mr",
    "Mrs",
    "Miss",
    "Lord",
    "Lady",
    "Sir",
    "Captain",
    "Daddy",
    "Mother",
    "Father",
    "England",
    "English",
    "America",
    "American",
    "Russian",
    "French",
    "God",
    "King",
    "Queen",
}
_SENT_RE = re.compile(r"(?<=[.!?])([\"”’']?)\s+(?=[\"“‘']?[A-Z])")


def paragraphs(text: str) -> list[str]:
    """Split a book into paragraphs with internal line wraps joined by spaces."""
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return [p for p in paras if p]


def sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences (keeping closing quotes attached)."""
    parts = _SENT_RE.split(paragraph)
    out: list[str] = []
    for i in range(0, len(parts), 2):
        quote = parts[i + 1] if i + 1 < len(parts) else ""
        sent = (parts[i] + quote).strip()
        if sent:
            out.append(sent)
    return out


def wrap(text: str, width: int = 70) -> str:
    """Hard-wrap text like the books (which the model was trained on) at ``width``."""
    return textwrap.fill(text, width=width, break_long_words=False, break_on_hyphens=False)


def wrapped_choice(context: str, choice: str) -> str:
    """The continuation of ``wrap(context)`` when ``choice`` follows it after a space.

    Starts with the separator the wrapping puts there (a space or a newline).
    """
    head, full = wrap(context), wrap(context + " " + choice)
    assert full.startswith(head), (head, full)
    return full[len(head) :]


def good_sentence(sent: str) -> bool:
    """True for ordinary prose sentences (not headings, not tiny, not huge)."""
    words = sent.split()
    return (
        5 <= len(words) <= 40
        and 25 <= len(sent) <= 220
        and not sent.isupper()
        and "CHAPTER" not in sent
        and sent[-1] in ".!?\"”’'"
    )


def build_rolling(heldout: dict[str, str], n: int, rng: random.Random) -> list[dict]:
    """Passages of 1000-2000 characters made of whole paragraphs (raw line wraps kept)."""
    chunks: list[dict] = []
    for book, text in heldout.items():
        raw_paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
        cur: list[str] = []
        for para in raw_paras:
            cur.append(para)
            size = sum(len(p) + 2 for p in cur)
            if size >= 1000:
                if size <= 2000:
                    chunks.append({"book": book, "text": "\n\n".join(cur)})
                cur = []
    picked = sorted(rng.sample(range(len(chunks)), min(n, len(chunks))))
    return [{"id": f"rolling-{i:04d}", **chunks[j]} for i, j in enumerate(picked)]


def sentence_table(heldout: dict[str, str]) -> list[tuple[str, int, str]]:
    """All (book, paragraph index, sentence) triples, in book order."""
    rows = []
    for book, text in heldout.items():
        for pi, para in enumerate(paragraphs(text)):
            rows.extend((book, pi, s) for s in sentences(para))
    return rows


def build_cloze(heldout: dict[str, str], n: int, rng: random.Random) -> list[dict]:
    """Four-way next-sentence choice; distractors are length-matched held-out sentences."""
    rows = sentence_table(heldout)
    pool = [i for i, r in enumerate(rows) if good_sentence(r[2])]
    candidates = []
    for i in range(4, len(rows)):
        ctx = rows[i - 4 : i]
        if good_sentence(rows[i][2]) and all(c[0] == rows[i][0] for c in ctx):
            text = " ".join(c[2] for c in ctx)
            if 150 <= len(text) <= 700 and rows[i - 1][1] >= rows[i][1] - 1:
                candidates.append((i, text))
    items = []
    for k, (i, context) in enumerate(sorted(rng.sample(candidates, n))):
        true = rows[i][2]
        near = [j for j in pool if abs(j - i) > 30 and 0.67 <= len(rows[j][2]) / len(true) <= 1.5]
        distractors = [rows[j][2] for j in rng.sample(near, 3)]
        plain = [true] + distractors
        rng.shuffle(plain)
        items.append(
            {
                "id": f"cloze-{k:04d}",
                "book": rows[i][0],
                "context": wrap(context),
                "choices": [wrapped_choice(context, c) for c in plain],
                "choices_plain": plain,
                "label": plain.index(true),
            }
        )
    return items


def character_names(text: str, min_count: int = 15) -> list[str]:
    """Capitalised words used as names: frequent, rarely lowercase, mostly mid-sentence."""
    caps = collections.Counter(re.findall(r"\b([A-Z][a-z]+)\b", text))
    low = collections.Counter(re.findall(r"\b([a-z]+)\b", text))
    mid = collections.Counter(re.findall(r"[a-z,;] ([A-Z][a-z]+)\b", text))
    return [
        w
        for w, c in caps.items()
        if c >= min_count and w not in NOT_NAMES and low[w.lower()] <= 0.02 * c and mid[w] >= 0.5 * c
    ]


def build_names(heldout: dict[str, str], n: int, rng: random.Random) -> list[dict]:
    """Contexts (300-800 chars) ending just before a name seen earlier in the context."""
    candidates = []
    for book, text in heldout.items():
        names = character_names(text)
        for m in re.finditer(r"\b(" + "|".join(names) + r")\b", text):
            if m.start() < 800 or text[m.start() - 1] not in " \n":
                continue
            length = rng.randint(300, 800)
            start = re.search(r"\s", text[m.start() - length :]).start() + m.start() - length + 1
            context = text[start : m.start()].rstrip()
            if re.search(r"\b" + m.group(1) + r"\b", context):
                candidates.append((book, m.start(), context, m.group(1)))
    rng.shuffle(candidates)
    picked: list[tuple[str, int, str, str]] = []
    for cand in candidates:  # keep items at least 1000 characters apart
        if all(c[0] != cand[0] or abs(c[1] - cand[1]) >= 1000 for c in picked):
            picked.append(cand)
        if len(picked) == n:
            break
    picked.sort()
    return [{"id": f"name-{k:04d}", "book": b, "context": ctx, "target": t} for k, (b, _, ctx, t) in enumerate(picked)]


def write_jsonl(path: pathlib.Path, items: list[dict]) -> None:
    """Write one JSON object per line (UTF-8, no ASCII escaping)."""
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Build all three evaluation files."""
    p = argparse.ArgumentParser(description="Build held-out evaluation JSONL files.")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent)
    p.add_argument("--corpus", type=pathlib.Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=300)
    args = p.parse_args(argv)
    _, heldout = split_books(load_books(args.corpus))
    builders = {"rolling_ppl": build_rolling, "cloze": build_cloze, "name_completion": build_names}
    for name, build in builders.items():
        items = build(heldout, args.n, random.Random(f"{args.seed}-{name}"))
        write_jsonl(args.out / f"{name}.jsonl", items)
        print(f"{name}: {len(items)} items -> {args.out / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
