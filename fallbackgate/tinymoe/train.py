"""python -m fallbackgate.tinymoe.train [--steps 3000 | --steps 0 --max-minutes 50] [--out DIR]

Train the bundled tiny Qwen3-MoE checkpoint from scratch on the public-domain
book corpus (``../shared/data/corpus``), holding out whole books
(:data:`fallbackgate.tinymoe.data.HELDOUT_BOOKS`).

Steps:
1. train a byte-level BPE tokenizer (``tokenizers``) on the training books;
2. train a ``Qwen3MoeForCausalLM`` (a dense first layer, then MoE layers with
   top-2 routing and a light load-balancing auxiliary loss; token embeddings
   initialised with std 1/sqrt(hidden), see :func:`init_model`) with AdamW and
   a cosine LR schedule on random 256-token windows, seeded;
3. save model (fp32 safetensors), tokenizer and ``training_info.json`` to the
   output directory (default: the package's ``checkpoint/``).

By default it reproduces the bundled checkpoint: 5 layers (1 dense + 4 MoE),
3000 steps, about an hour on one thread of this 2-core machine. With ``--steps 0`` the step count is
derived from ``--max-minutes`` by timing the first steps; the chosen count is
logged and stored in ``training_info.json`` so a run can be repeated with
``--steps``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import shutil
import time

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tinymoe.data import (
    EOS_TOKEN,
    HELDOUT_BOOKS,
    default_corpus_dir,
    load_books,
    split_books,
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it for ``AutoTokenizer``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=1024,
    )


def build_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> Qwen3MoeConfig:
    """Return the model configuration (top-2 of ``--experts``; the first ``--dense-layers`` layers dense)."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=2,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(args.dense_layers)),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        rms_norm_eps=1e-6,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
    )


def init_model(config: Qwen3MoeConfig, seed: int, embed_std: float) -> Qwen3MoeForCausalLM:
    """A freshly initialised model: transformers' init, then token embeddings N(0, ``embed_std``).

    transformers draws every weight, embeddings included, from N(0, 0.02). At
    hidden size 192 that makes each token's embedding small next to what the
    attention layers add, so the residual stream of a random model is dominated
    by a running mean over the prefix and its deeper routers pick nearly the
    same experts for every token. Embeddings of std 1/sqrt(hidden) (unit-variance
    tied output logits) keep the token identity visible at initialisation.
    """
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, embed_std)
    return model


def encode_books(tokenizer: PreTrainedTokenizerFast, books: dict[str, str]) -> np.ndarray:
    """Tokenise books into one int32 stream, books separated by the EOS token."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    parts: list[np.ndarray] = []
    for name in sorted(books):
        ids = tokenizer(books[name], add_special_tokens=False)["input_ids"]
        parts.append(np.asarray(ids + [eos], dtype=np.int32))
    return np.concatenate(parts)


def sample_batch(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> torch.Tensor:
    """Draw ``batch`` random windows of ``seq + 1`` tokens from the stream."""
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10 % of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def eval_loss(model: Qwen3MoeForCausalLM, stream: np.ndarray, seq: int, n_windows: int) -> float:
    """Mean next-token loss on ``n_windows`` evenly spaced held-out windows."""
    model.eval()
    starts = np.linspace(0, len(stream) - seq - 2, n_windows).astype(int)
    x = torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))
    out = model(input_ids=x, labels=x, output_router_logits=False)
    model.train()
    return float(out.loss)


def train_loop(model: Qwen3MoeForCausalLM, train_ids: np.ndarray, val_ids: np.ndarray,
               args: argparse.Namespace) -> dict:
    """Run the optimisation loop; return a summary dictionary."""
    rng = np.random.default_rng(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1, eps=1e-8)
    total = args.steps or 10**9
    budget_s = args.max_minutes * 60.0 if not args.steps else math.inf  # a fixed step count always completes
    t0 = time.time()
    step, tokens, history = 0, 0, []
    model.train()
    while step < total and time.time() - t0 < budget_s:
        lr = lr_at(step, total if total < 10**9 else 10**4, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x = sample_batch(train_ids, args.batch, args.seq, rng)
        out = model(input_ids=x, labels=x)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel() - x.shape[0]
        if not args.steps and step == args.calibrate_steps:
            per_step = (time.time() - t0) / step
            total = int(budget_s * 0.97 / per_step)
            print(f"calibrated: {per_step:.3f} s/step -> {total} steps", flush=True)
        if step % args.log_every == 0 or step == total:
            aux = float(out.aux_loss.detach()) if out.aux_loss is not None else float("nan")
            rec = {"step": step, "tokens": tokens, "lr": lr, "loss": float(out.loss),
                   "aux": aux, "elapsed_s": round(time.time() - t0, 1)}
            if step % (args.log_every * 10) == 0:
                rec["val_loss"] = eval_loss(model, val_ids, args.seq, 16)
            history.append(rec)
            print(json.dumps(rec), flush=True)
    return {"steps": step, "planned_steps": total, "tokens_trained": tokens,
            "train_wall_s": round(time.time() - t0, 1), "history": history,
            "final_val_loss": eval_loss(model, val_ids, args.seq, 32)}


def make_tokenizer_config_portable(out: pathlib.Path) -> None:
    """Name the generic fast-tokenizer class so transformers 4.x loads it too."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=pathlib.Path, default=None)
    p.add_argument("--out", type=pathlib.Path, default=CHECKPOINT_DIR)
    p.add_argument("--max-minutes", type=float, default=50.0)
    p.add_argument("--steps", type=int, default=3000,
                   help="fixed step count, the bundled checkpoint's by default (0: derive it from --max-minutes)")
    p.add_argument("--calibrate-steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--dense-layers", type=int, default=1, help="how many first layers have a dense MLP, not experts")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=128)
    p.add_argument("--embed-std", type=float, default=0.0,
                   help="std of the initial token embeddings (0: 1/sqrt(hidden))")
    p.add_argument("--aux-coef", type=float, default=0.001)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--log-every", type=int, default=25)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train tokenizer and model, then save the checkpoint directory."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    corpus_dir = args.corpus or default_corpus_dir()
    train_books, heldout_books = split_books(load_books(corpus_dir))
    t0 = time.time()
    tokenizer = train_tokenizer([train_books[k] for k in sorted(train_books)], args.vocab)
    train_ids = encode_books(tokenizer, train_books)
    val_ids = encode_books(tokenizer, heldout_books)
    print(f"tokenizer {len(tokenizer)} tokens in {time.time() - t0:.1f}s; "
          f"train {len(train_ids):,} tokens, held-out {len(val_ids):,} tokens", flush=True)
    config = build_config(tokenizer, args)
    embed_std = args.embed_std or args.hidden ** -0.5
    model = init_model(config, args.seed, embed_std)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params: {n_params:,}", flush=True)
    summary = train_loop(model, train_ids, val_ids, args)
    args.out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    make_tokenizer_config_portable(args.out)
    sources = corpus_dir / "SOURCES.md"
    if sources.exists():
        shutil.copyfile(sources, args.out / "SOURCES.md")
    info = {"params": n_params, "train_corpus_tokens": len(train_ids),
            "heldout_books": list(HELDOUT_BOOKS), "train_books": sorted(train_books),
            "args": {k: str(v) for k, v in vars(args).items()},
            "embed_std": embed_std, "torch_threads": args.threads, **summary}
    (args.out / "training_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"saved to {args.out}: {summary['steps']} steps, {summary['tokens_trained']:,} tokens, "
          f"{summary['train_wall_s']}s, val loss {summary['final_val_loss']:.3f}", flush=True)


if __name__ == "__main__":
    main()
