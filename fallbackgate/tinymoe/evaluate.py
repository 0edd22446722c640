"""python -m fallbackgate.tinymoe.evaluate [--checkpoint DIR] [--data evals/data] [--limit N]

Evaluate the bundled tiny MoE checkpoint on the held-out evaluation sets and
write ``eval_results.json`` into the checkpoint directory; then regenerate the
numbers section of the model card (``README.md`` between the
``<!-- EVAL:BEGIN -->`` / ``<!-- EVAL:END -->`` markers), also printed.

Measured: held-out perplexity (sliding 256-token windows, and whole passages)
against an add-0.5 token unigram model fitted on the training books; cloze
accuracy; name-completion exact match; a greedy sample; and per-layer routing
statistics (load entropy, expert reuse) for the trained model and for a
randomly initialised model of the same shape.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fallbackgate.resources import package_dir
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tinymoe import metrics as M
from fallbackgate.tinymoe.data import load_books, split_books
from fallbackgate.tinymoe.train import init_model

DATA_DIR = package_dir("fallbackgate.evals") / "data"
BEGIN, END = "<!-- EVAL:BEGIN -->", "<!-- EVAL:END -->"


def read_jsonl(path: pathlib.Path, limit: int | None = None) -> list[dict]:
    """Read a JSONL file (first ``limit`` items if given)."""
    with path.open(encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    return items[:limit] if limit else items


def routing_windows(tokenizer, texts: list[str], n_windows: int, seq: int) -> torch.Tensor:
    """``n_windows`` consecutive ``seq``-token windows from the concatenated texts."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_windows * seq:
            break
    n = min(n_windows, len(ids) // seq)
    return torch.tensor(ids[: n * seq], dtype=torch.long).reshape(n, seq)


def routing_report(model, windows: torch.Tensor) -> list[dict]:
    """Routing statistics for every MoE layer of ``model`` on ``windows``."""
    return [M.routing_stats(mask) for mask in M.expert_choices(model, windows)]


def random_init_model(ckpt: pathlib.Path, config, seed: int):
    """A model of the checkpoint's shape, initialised as the training recipe initialises its model."""
    info_path = ckpt / "training_info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    embed_std = float(info.get("embed_std", config.initializer_range))
    return init_model(config, seed, embed_std).eval()


def evaluate(ckpt: pathlib.Path, data: pathlib.Path, limit: int | None, seed: int) -> dict:
    """Run every measurement and return the results dictionary."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    rolling = read_jsonl(data / "rolling_ppl.jsonl", limit)
    res: dict = {"n_params": sum(p.numel() for p in model.parameters())}
    t0 = time.time()
    lp, ids = M.passage_logprobs(model, tok, [r["text"] for r in rolling])
    lp_full, _ = M.passage_logprobs(model, tok, [r["text"] for r in rolling], window=1024, stride=512)
    train_books, _ = split_books(load_books())
    unigram = M.UnigramModel.fit(tok, train_books.values())
    res["perplexity"] = {
        "n_passages": len(rolling), "n_tokens": int(lp.size),
        "model_ppl_window256": M.perplexity(lp), "model_ppl_full_passage": M.perplexity(lp_full),
        "unigram_ppl": M.perplexity(unigram.logprobs(ids)),
    }
    res["cloze"] = M.cloze_accuracy(model, tok, read_jsonl(data / "cloze.jsonl", limit))
    res["name_completion"] = M.name_completion_accuracy(
        model, tok, read_jsonl(data / "name_completion.jsonl", limit))
    prompt = rolling[0]["text"][:300].rsplit(" ", 1)[0]
    res["greedy_sample"] = {"prompt": prompt,
                            "continuation": M.greedy_continuation(model, tok, prompt, 60)}
    windows = routing_windows(tok, [r["text"] for r in rolling], 64, 256)
    res["routing"] = {"n_tokens": int(windows.numel()), "trained": routing_report(model, windows)}
    config = AutoConfig.from_pretrained(ckpt)
    res["routing"]["random_init"] = routing_report(random_init_model(ckpt, config, seed), windows)
    torch.manual_seed(seed)
    default_init = AutoModelForCausalLM.from_config(config).eval()
    res["routing"]["random_init_default"] = routing_report(default_init, windows)
    res["eval_wall_s"] = round(time.time() - t0, 1)
    return res


def acceptance_checks(res: dict) -> list[tuple[str, bool, str]]:
    """The model issue's done-when criteria as (check, passed, measured) rows."""
    ppl, cloze, rt = res["perplexity"], res["cloze"], res["routing"]
    tr, rd = rt["trained"], rt["random_init"]
    model_ppl, unigram_ppl = ppl["model_ppl_window256"], ppl["unigram_ppl"]
    rows = [
        ("held-out perplexity below a quarter of the unigram's", model_ppl * 4 < unigram_ppl,
         f"{model_ppl:.2f} vs {unigram_ppl:.2f}"),
        ("cloze accuracy (mutual info) >= 45 %", cloze["acc_mutual_info"] >= 0.45, f"{cloze['acc_mutual_info']:.1%}"),
        ("expert loads more skewed than random init, every MoE layer",
         all(t["entropy_ratio"] < r["entropy_ratio"] for t, r in zip(tr, rd, strict=True)),
         f"entropy ratio {fmt_layers(tr, 'entropy_ratio')} vs {fmt_layers(rd, 'entropy_ratio')}"),
    ]
    for k in (1, 4, 16):
        rows.append((f"reuse@{k} above random init, every MoE layer",
                     all(t[f"reuse@{k}"] > r[f"reuse@{k}"] for t, r in zip(tr, rd, strict=True)),
                     f"{fmt_layers(tr, f'reuse@{k}')} vs {fmt_layers(rd, f'reuse@{k}')}"))
    return rows


def moe_layer_ids(cfg: dict) -> list[int]:
    """Indices of the decoder layers that route to experts."""
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(cfg["num_hidden_layers"]) if i not in dense]


def layer_kinds(cfg: dict) -> str:
    """'4 layers, all MoE' or '5 layers: layer 0 dense, 4 MoE'."""
    n, moe = cfg["num_hidden_layers"], moe_layer_ids(cfg)
    dense = [i for i in range(n) if i not in moe]
    if not dense:
        return f"{n} layers, all MoE"
    return f"{n} layers: layer{'s' if len(dense) > 1 else ''} {', '.join(map(str, dense))} dense, {len(moe)} MoE"


def fmt_layers(stats: list[dict], key: str, digits: int = 3) -> str:
    """Per-layer values of ``key`` joined by ' / '."""
    return " / ".join(f"{s[key]:.{digits}f}" for s in stats)


def _quantity_rows(res: dict, info: dict, cfg: dict) -> list[str]:
    """The card's table of the model's shape, training and held-out quality."""
    ppl = res["perplexity"]
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return [
        "| Quantity | Value |", "|---|---|",
        (f"| Architecture | `{cfg['architectures'][0]}`: {layer_kinds(cfg)}; "
        f"{n_experts} routed experts per MoE layer, top-{cfg['num_experts_per_tok']}; hidden "
        f"{cfg['hidden_size']}, expert FFN {cfg['moe_intermediate_size']}, {cfg['num_attention_heads']} "
        f"heads ({cfg['num_key_value_heads']} KV), vocab {cfg['vocab_size']}, tied embeddings |"),
        f"| Parameters | {res['n_params']:,} (fp32) |",
        (f"| Tokens trained | {info['tokens_trained']:,} ({info['steps']} steps; training corpus "
        f"{info['train_corpus_tokens']:,} tokens) |"),
        f"| Training wall time | {info['train_wall_s'] / 60:.1f} min on {info['torch_threads']} CPU thread(s) |",
        f"| Held-out books | {', '.join(info['heldout_books'])} |",
        (f"| Held-out perplexity (per token, 256-token windows) | **{ppl['model_ppl_window256']:.2f}** "
        f"({ppl['n_passages']} passages, {ppl['n_tokens']:,} tokens) |"),
        f"| Held-out perplexity, whole passages in one window | {ppl['model_ppl_full_passage']:.2f} |",
        f"| Unigram perplexity, same tokens | **{ppl['unigram_ppl']:.2f}** |",
        (f"| Cloze accuracy (4-way, chance 25%), context-conditional minus unconditional log-lik "
         f"(mutual info) | **{res['cloze']['acc_mutual_info']:.1%}** (n={res['cloze']['n']}) |"),
        (f"| Cloze accuracy, sum log-lik / log-lik per character | {res['cloze']['acc']:.1%} / "
         f"{res['cloze']['acc_norm']:.1%} |"),
        (f"| Name completion exact match (greedy) | {res['name_completion']['exact_match']:.1%} "
        f"(n={res['name_completion']['n']}) |"),
    ]  # fmt: skip


def _routing_rows(rt: dict, cfg: dict) -> list[str]:
    """The card's routing statistics per MoE layer, trained against random init, and the note on transformers'
    default initialisation when it was measured."""
    lines = [
        "", (f"Routing statistics per MoE layer (layers {' / '.join(map(str, moe_layer_ids(cfg)))}; "
        f"{rt['n_tokens']:,} held-out tokens). "
        "Entropy ratio = expert-load entropy / log(number of experts) (1 = uniform); reuse@k = "
        "P(an expert used at token t is used again within tokens t+1..t+k); "
        "'indep.' = that probability if tokens drew experts independently with the same loads."), "",
        "| Statistic | Trained | Random init |", "|---|---|---|",
    ]  # fmt: skip
    tr, rd = rt["trained"], rt["random_init"]
    lines.append(f"| Load entropy ratio | {fmt_layers(tr, 'entropy_ratio')} | {fmt_layers(rd, 'entropy_ratio')} |")
    lines.append(f"| Max load / mean load | {fmt_layers(tr, 'max_load_over_mean', 2)} | "
                 f"{fmt_layers(rd, 'max_load_over_mean', 2)} |")  # fmt: skip
    for k in (1, 4, 16):
        lines.append(f"| reuse@{k} | {fmt_layers(tr, f'reuse@{k}')} | {fmt_layers(rd, f'reuse@{k}')} |")
        lines.append(f"| reuse@{k} (indep.) | {fmt_layers(tr, f'reuse_indep@{k}')} | "
                     f"{fmt_layers(rd, f'reuse_indep@{k}')} |")  # fmt: skip
    dflt = rt.get("random_init_default")
    if dflt:
        lines += ["", ("With transformers' default initialisation instead (token embeddings of std "
                  "0.02 like every other weight), the random model's reuse@1 is "
                  f"{fmt_layers(dflt, 'reuse@1')} and reuse@16 {fmt_layers(dflt, 'reuse@16')}: "
                  "such small embeddings leave deeper layers' router inputs dominated by a running "
                  "mean over the prefix, so neighbouring tokens pick the same experts whatever the "
                  "text. That is why the recipe initialises embeddings with std 1/sqrt(hidden) and "
                  "why the random column above is initialised as the recipe initialises its model.")]  # fmt: skip
    return lines


def render_section(res: dict, info: dict, cfg: dict) -> str:
    """Markdown for the card's generated numbers section."""
    lines = _quantity_rows(res, info, cfg) + _routing_rows(res["routing"], cfg)
    lines += ["", "Acceptance checks (the model issue's done-when criteria):", "",
              "| Check | Result | Measured (trained vs reference) |", "|---|---|---|"]  # fmt: skip
    for name, ok, measured in acceptance_checks(res):
        lines.append(f"| {name} | {'pass' if ok else '**FAIL**'} | {measured} |")
    sample = res["greedy_sample"]
    lines += ["", "Greedy sample from the start of a held-out passage (prompt, then *model text*):", "",
              "> " + sample["prompt"].replace("\n", " ") + " *"
              + sample["continuation"].replace("\n", " ").strip() + "*"]  # fmt: skip
    return "\n".join(lines)


def update_card(card: pathlib.Path, section: str) -> None:
    """Replace the text between the EVAL markers of ``card`` with ``section``."""
    text = card.read_text(encoding="utf-8") if card.exists() else f"{BEGIN}\n{END}\n"
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.DOTALL)
    text = pattern.sub(lambda _: f"{BEGIN}\n{section}\n{END}", text)
    card.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    """Evaluate, save ``eval_results.json`` and refresh the model card."""
    p = argparse.ArgumentParser(description="Evaluate the tiny MoE checkpoint.")
    p.add_argument("--checkpoint", type=pathlib.Path, default=CHECKPOINT_DIR)
    p.add_argument("--data", type=pathlib.Path, default=DATA_DIR)
    p.add_argument("--limit", type=int, default=None, help="use only the first N items per set")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seed for the random-init comparison model")
    p.add_argument("--no-card", action="store_true", help="do not rewrite README.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    res = evaluate(args.checkpoint, args.data, args.limit, args.seed)
    (args.checkpoint / "eval_results.json").write_text(json.dumps(res, indent=1) + "\n")
    info = json.loads((args.checkpoint / "training_info.json").read_text())
    cfg = json.loads((args.checkpoint / "config.json").read_text())
    section = render_section(res, info, cfg)
    if not args.no_card:
        update_card(args.checkpoint / "README.md", section)
    print(section)
    failed = [name for name, ok, _ in acceptance_checks(res) if not ok]
    if failed:
        raise SystemExit(f"acceptance checks failed: {failed}")


if __name__ == "__main__":
    main()
