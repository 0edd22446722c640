"""Scoring functions for the tiny MoE checkpoint: perplexity, cloze, names, routing.

All functions take an already loaded ``transformers`` causal LM and tokenizer
and run on CPU in fp32. Texts are scored after a leading EOS token (the model's
BOS), so every token of a passage is predicted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def bos_id(tokenizer) -> int:
    """The id used as beginning-of-sequence (the EOS token for this model)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


@torch.no_grad()
def token_logprobs(model, ids: Sequence[int], window: int = 256, stride: int = 128) -> np.ndarray:
    """Log-probability of ``ids[1:]`` given the preceding ids, using sliding windows.

    Each window holds at most ``window`` tokens; after the first window the
    window advances by ``stride`` and only its last ``stride`` targets are scored,
    so every target is scored exactly once with at least ``window - stride``
    tokens of context.
    """
    ids_t = torch.tensor(ids, dtype=torch.long)
    out = np.empty(len(ids) - 1, dtype=np.float64)
    start, done = 0, 0  # done: number of targets scored so far
    while done < len(ids) - 1:
        end = min(start + window, len(ids))
        chunk = ids_t[start:end].unsqueeze(0)
        logp = F.log_softmax(model(input_ids=chunk).logits[0, :-1].float(), dim=-1)
        lp = logp.gather(1, chunk[0, 1:].unsqueeze(1)).squeeze(1).numpy()
        first = done - start  # index in lp of the first target not yet scored
        out[done:end - 1] = lp[first:]
        done = end - 1
        start = max(0, end - window + stride) if end < len(ids) else end
        start = min(start, done)
    return out


def passage_logprobs(model, tokenizer, texts: Iterable[str], window: int = 256,
                     stride: int = 128) -> tuple[np.ndarray, list[list[int]]]:
    """Concatenated per-token log-probs of all passages, and the scored token ids."""
    all_lp, all_ids = [], []
    for text in texts:
        ids = [bos_id(tokenizer)] + tokenizer(text, add_special_tokens=False)["input_ids"]
        all_lp.append(token_logprobs(model, ids, window, stride))
        all_ids.append(ids[1:])
    return np.concatenate(all_lp), all_ids


class UnigramModel:
    """Add-``alpha`` smoothed token unigram model over the tokenizer vocabulary."""

    def __init__(self, counts: np.ndarray, alpha: float = 0.5) -> None:
        probs = (counts.astype(np.float64) + alpha) / (counts.sum() + alpha * len(counts))
        self.logp = np.log(probs)

    @classmethod
    def fit(cls, tokenizer, texts: Iterable[str], alpha: float = 0.5) -> UnigramModel:
        """Count tokens of ``texts`` (e.g. the training books)."""
        counts = np.zeros(len(tokenizer), dtype=np.int64)
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            counts += np.bincount(ids, minlength=len(counts))[: len(counts)]
        return cls(counts, alpha)

    def logprobs(self, id_lists: Iterable[Sequence[int]]) -> np.ndarray:
        """Per-token log-probabilities of the given token id lists, concatenated."""
        return np.concatenate([self.logp[np.asarray(ids)] for ids in id_lists])


def perplexity(logprobs: np.ndarray) -> float:
    """exp of the mean negative log-likelihood."""
    return float(math.exp(-float(np.mean(logprobs))))


@torch.no_grad()
def continuation_logprobs(model, tokenizer, context: str, continuations: Sequence[str],
                          delimiter: str = "") -> list[float]:
    """Summed log-probability of each ``delimiter + continuation`` after ``context``."""
    ctx = [bos_id(tokenizer)] + tokenizer(context, add_special_tokens=False)["input_ids"]
    conts = [tokenizer(delimiter + c, add_special_tokens=False)["input_ids"] for c in continuations]
    seqs = [ctx + c for c in conts]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    batch = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    logp = F.log_softmax(model(input_ids=batch, attention_mask=mask).logits.float(), dim=-1)
    scores = []
    for row, cont in enumerate(conts):
        positions = torch.arange(len(ctx) - 1, len(ctx) - 1 + len(cont))
        targets = torch.tensor(cont, dtype=torch.long)
        scores.append(float(logp[row, positions, targets].sum()))
    return scores


def cloze_accuracy(model, tokenizer, items: Sequence[dict]) -> dict[str, float]:
    """Cloze accuracy under three scorings of each choice.

    ``acc``: summed log-likelihood of the choice after the context;
    ``acc_norm``: the same per character; ``acc_mutual_info``: summed
    log-likelihood after the context minus that after an empty context (BOS
    only), i.e. how much the context raises the choice's probability (lm-eval's
    ``acc_mutual_info``). Choices already carry their leading separator (see
    ``evals/data/README.md``).
    """
    hits = np.zeros(3)
    for item in items:
        cond = np.array(continuation_logprobs(model, tokenizer, item["context"], item["choices"]))
        uncond = np.array(continuation_logprobs(model, tokenizer, "", item["choices"]))
        lengths = np.array([len(c) for c in item["choices"]])
        for i, score in enumerate((cond, cond / lengths, cond - uncond)):
            hits[i] += int(np.argmax(score) == item["label"])
    acc = hits / len(items)
    return {"acc": acc[0], "acc_norm": acc[1], "acc_mutual_info": acc[2], "n": len(items)}


@torch.no_grad()
def greedy_continuation(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy-decoded continuation text of ``prompt`` (prompt excluded)."""
    ids = [bos_id(tokenizer)] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids], dtype=torch.long)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def first_word(text: str) -> str:
    """The first run of letters in ``text`` ('' if none)."""
    match = re.search(r"[A-Za-z]+", text)
    return match.group(0) if match else ""


def name_completion_accuracy(model, tokenizer, items: Sequence[dict], max_new_tokens: int = 6) -> dict:
    """Exact match of the first generated word against the target name."""
    hits = sum(first_word(greedy_continuation(model, tokenizer, it["context"], max_new_tokens))
               == it["target"] for it in items)
    return {"exact_match": hits / len(items), "n": len(items)}


@torch.no_grad()
def expert_choices(model, id_windows: torch.Tensor) -> list[np.ndarray]:
    """Per layer, a boolean array [windows, tokens, experts]: which experts each token used."""
    out = model(input_ids=id_windows, output_router_logits=True)
    k = model.config.num_experts_per_tok
    b, t = id_windows.shape
    layers = []
    for logits in out.router_logits:
        top = logits.float().topk(k, dim=-1).indices.reshape(b, t, k)
        mask = torch.zeros(b, t, logits.shape[-1], dtype=torch.bool)
        mask.scatter_(2, top, True)
        layers.append(mask.numpy())
    return layers


def routing_stats(masks: np.ndarray, horizons: Sequence[int] = (1, 4, 16)) -> dict:
    """Load entropy and reuse probabilities for one layer's [windows, tokens, experts] mask.

    ``reuse@k`` is the probability that an expert used at token t is used again at
    one of tokens t+1..t+k (same window); ``reuse_indep@k`` is the same
    probability if tokens picked experts independently with the observed loads.
    """
    n_experts = masks.shape[-1]
    load = masks.sum(axis=(0, 1)).astype(np.float64)
    p = load / load.sum()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    q = masks.mean(axis=(0, 1))  # probability that a token uses each expert
    stats = {"load": p.round(4).tolist(), "entropy": entropy, "entropy_uniform": math.log(n_experts),
             "entropy_ratio": entropy / math.log(n_experts), "max_load_over_mean": float(p.max() * n_experts)}
    cs = np.concatenate([np.zeros_like(masks[:, :1], dtype=np.int64),
                         np.cumsum(masks, axis=1, dtype=np.int64)], axis=1)
    for k in horizons:
        t = masks.shape[1] - k
        future = cs[:, k + 1:k + 1 + t] - cs[:, 1:1 + t]  # uses in tokens t+1..t+k
        used = masks[:, :t]
        stats[f"reuse@{k}"] = float((used & (future > 0)).sum() / used.sum())
        stats[f"reuse_indep@{k}"] = float((q * (1 - (1 - q) ** k)).sum() / q.sum())
    return stats
