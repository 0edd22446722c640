"""Fast checks of the bundled tiny MoE checkpoint (offline load, English, ppl, cloze)."""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fallbackgate.tinymoe import CHECKPOINT_DIR  # noqa: E402
from fallbackgate.tinymoe import metrics as M  # noqa: E402
from fallbackgate.tinymoe.data import default_corpus_dir, load_books, split_books  # noqa: E402
from fallbackgate.tinymoe.evaluate import moe_layer_ids, random_init_model, routing_report, routing_windows  # noqa: E402

DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "evals" / "data"
needs_ckpt = pytest.mark.skipif(
    not (CHECKPOINT_DIR / "model.safetensors").exists(), reason="checkpoint not built"
)
# CI (FALLBACKGATE_REQUIRE_CORPUS=1, set by .ci/test) has ../shared beside the clone: there a missing corpus fails.
needs_corpus = pytest.mark.skipif(
    not default_corpus_dir().exists() and os.environ.get("FALLBACKGATE_REQUIRE_CORPUS") != "1",
    reason="corpus not available",
)


def read_jsonl(name: str, limit: int) -> list[dict]:
    """First ``limit`` items of an evaluation file."""
    with (DATA_DIR / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f][:limit]


@pytest.fixture(scope="module")
def lm():
    """The checkpoint's model (fp32, eval mode) and tokenizer, loaded offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)  # fast enough, and leaves other cores free
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR).eval()
    tok = transformers.AutoTokenizer.from_pretrained(CHECKPOINT_DIR)
    return model, tok


@pytest.fixture(scope="module")
def train_books() -> dict[str, str]:
    """Training books (held-out books removed)."""
    return split_books(load_books())[0]


@needs_ckpt
def test_checkpoint_shape_and_size(lm) -> None:
    model, tok = lm
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert next(model.parameters()).dtype == torch.float32
    assert cfg.num_experts >= 16 and cfg.num_experts_per_tok >= 2
    assert cfg.decoder_sparse_step == 1 and len(moe_layer_ids(cfg.to_dict())) >= 4
    assert cfg.max_position_embeddings >= 1024 and len(tok) == cfg.vocab_size
    size = sum(p.stat().st_size for p in CHECKPOINT_DIR.rglob("*") if p.is_file())
    assert size <= 30 * 1024 * 1024


@needs_ckpt
@needs_corpus
def test_greedy_text_is_english(lm, train_books) -> None:
    model, tok = lm
    vocab = {
        w.lower()
        for text in train_books.values()
        for w in re.findall(r"[A-Za-z]+", text)
    }
    in_vocab, total = 0, 0
    for item in read_jsonl("rolling_ppl.jsonl", 3):
        prompt = item["text"][:200].rsplit(" ", 1)[0]
        words = re.findall(r"[A-Za-z]+", M.greedy_continuation(model, tok, prompt, 32))
        in_vocab += sum(w.lower() in vocab for w in words)
        total += len(words)
    assert total >= 25
    assert in_vocab / total >= 0.9


@needs_ckpt
@needs_corpus
def test_heldout_perplexity_beats_unigram(lm, train_books) -> None:
    model, tok = lm
    texts = [r["text"] for r in read_jsonl("rolling_ppl.jsonl", 8)]
    logprobs, ids = M.passage_logprobs(model, tok, texts)
    # a unigram fitted on every 4th training book: token frequencies are stable at this size
    subset = [train_books[k] for k in sorted(train_books)[::4]]
    unigram_ppl = M.perplexity(M.UnigramModel.fit(tok, subset).logprobs(ids))
    model_ppl = M.perplexity(logprobs)
    assert model_ppl * 4 < unigram_ppl, (model_ppl, unigram_ppl)


@needs_ckpt
def test_cloze_accuracy_above_chance(lm) -> None:
    model, tok = lm
    result = M.cloze_accuracy(model, tok, read_jsonl("cloze.jsonl", 48))
    assert result["acc_mutual_info"] >= 0.38, result


def test_routing_stats_reuse_definition() -> None:
    import numpy as np

    # one window, 4 tokens, 3 experts, top-1: expert 0,0,1,0
    masks = np.zeros((1, 4, 3), dtype=bool)
    masks[0, [0, 1, 3], 0] = True
    masks[0, 2, 1] = True
    stats = M.routing_stats(masks, horizons=(1, 2))
    assert stats["reuse@1"] == pytest.approx(1 / 3)  # t=0 reused at t=1; t=1, t=2 not
    assert stats["reuse@2"] == pytest.approx(1.0)  # t=0 -> t=1, t=1 -> t=3
    assert stats["entropy_ratio"] < 1.0


@needs_ckpt
@needs_corpus
def test_trained_routing_is_more_skewed_and_more_reused_than_random_init(lm) -> None:
    model, tok = lm
    # the model card's sample: 64 consecutive 256-token windows of the held-out passages
    texts = [r["text"] for r in read_jsonl("rolling_ppl.jsonl", 300)]
    windows = routing_windows(tok, texts, 64, 256)
    assert windows.shape == (64, 256)
    trained = routing_report(model, windows)
    random = routing_report(random_init_model(CHECKPOINT_DIR, model.config, 0), windows)
    for layer, (t, r) in enumerate(zip(trained, random, strict=True)):
        assert t["entropy_ratio"] < r["entropy_ratio"] - 0.05, (layer, t["entropy_ratio"], r["entropy_ratio"])
        for k in (1, 4, 16):
            assert t[f"reuse@{k}"] > r[f"reuse@{k}"], (layer, k, t[f"reuse@{k}"], r[f"reuse@{k}"])
