"""What audits need from an engine: its dense weights checked, the exact-baseline passes and the replay pass.

A mixin of :class:`fallbackgate.engine.engine.Engine`; every pass computes routed experts from the checkpoint
files (through the audit's own verified cache, or the replay's hooks) and never from the stores. The audit
reaches these through :mod:`fallbackgate.engine.baseline.api`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import Cache

from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.experts.integrity import verify_dense
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.messages import Verification
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.step_context import EventLog, ForwardBatch, ReplayHooks, StepContext


class BaselineAccess:
    """Exact-baseline entry points over the engine's model and executor."""

    runner: ModelRunner
    executor: Executor
    device: torch.device
    tokenizer: PreTrainedTokenizerBase | None
    dense_digests: dict[str, str]

    def verify_dense(self) -> list[Verification]:
        """Check every dense weight against the digest of what the loader read from the checkpoint."""
        return verify_dense(self.runner.model, self.dense_digests)

    @property
    def num_layers(self) -> int:
        """Decoder layers (each with its own K/V)."""
        return self.executor.kv_store.num_layers

    @property
    def block_size(self) -> int:
        """Tokens per KV block (a replay reads blocks as they were served)."""
        return self.executor.kv_store.block_size

    @property
    def kv_key_dim(self) -> int:
        """Key channels per token in a packed K/V block (values follow)."""
        return self.executor.kv_store.key_dim

    def verify_audit_copies(self) -> list[Verification]:
        """Re-check every expert copy the audit holds against its checksum at fill; the failures found
        since the last call (sampled uses included). Called at the end of each audit."""
        return self.executor.audit_weights.verify_all()

    def audit_expert(self, key: ExpertKey) -> ExpertWeights:
        """One routed expert as the checkpoint files hold it (verified, in the compute dtype), on the device."""
        return self.executor.audit_weights.get(key, self.device)

    def router_scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The router logits [T, num_experts] of `layer` for the experts' input `hidden` [T, H] (None when the
        layer's router is not a plain [num_experts, hidden] projection)."""
        router = self.executor.routers.get(layer)
        if router is None:
            return None
        return torch.nn.functional.linear(hidden.to(router.weight.dtype), router.weight)

    def replay_forward(
        self, hooks: ReplayHooks, cache: Cache, token_ids: list[int], start: int, logits_rows: list[int]
    ) -> torch.Tensor:
        """One audit replay forward of one request's tokens at positions start..: `hooks` supply the experts
        and attention, `cache` the K/V; fp32 logits at `logits_rows` (nothing recorded, no store touched)."""
        n = len(token_ids)
        batch = ForwardBatch(["replay"], [start], [n], torch.zeros(n, dtype=torch.long), ["replay"])
        self.executor.ctx = StepContext(-1, batch, EventLog(-1), replay=hooks)
        keep = torch.tensor(logits_rows or [n - 1], device=self.device)
        try:
            with torch.inference_mode():
                out = self.runner.model(
                    input_ids=torch.tensor([token_ids], device=self.device),
                    position_ids=torch.arange(start, start + n, device=self.device)[None],
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
        finally:
            self.executor.ctx = None
        return out.logits[0].float()

    def exact_hidden(self, sequences: list[list[int]]) -> torch.Tensor:
        """Exact baseline for several token sequences in one batched pass: final hidden states [B, L, H]
        (after the model's last norm), sequences right-padded to the longest with the tokenizer's pad token
        (causal attention keeps padding out of every real position). Each routed expert is read once per
        layer for the whole batch, from the checkpoint files through the audit's own verified cache. Logits
        come from :meth:`exact_head`."""
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        pad_id = pad if pad is not None else 0
        length = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
        for row, tokens in enumerate(sequences):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        num = ids.numel()
        batch = ForwardBatch(["audit"], [0], [num], torch.zeros(num, dtype=torch.long), ["audit"])
        self.executor.ctx = StepContext(-1, batch, EventLog(-1), is_exact_baseline=True)
        try:
            with torch.inference_mode():
                return self.runner.model.get_decoder()(input_ids=ids.to(self.device), use_cache=False).last_hidden_state
        finally:
            self.executor.ctx = None

    def exact_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states [N, H] (the model's own output layer)."""
        with torch.inference_mode():
            return self.runner.model.get_output_embeddings()(hidden).float()

    def exact_chunks(self, token_ids: list[int], first: int, chunk: int) -> Iterator[torch.Tensor]:
        """Exact baseline logits at positions first.. of `token_ids`, as [<= chunk, vocab] fp32 chunks: one
        pass over the tokens before `first`, then `chunk` positions per pass on transformers' own cache, so
        at most `chunk` full-vocabulary rows exist at once. Experts are read and checked as in
        :meth:`exact_logits`."""
        ids = torch.tensor([token_ids], device=self.device)
        batch = ForwardBatch(["audit"], [0], [len(token_ids)], torch.zeros(len(token_ids), dtype=torch.long), ["audit"])
        reader = self.executor.expert_store.reader
        cache = DynamicCache(config=self.runner.model.config)
        for start in range(0, len(token_ids), chunk) if first == 0 else [0, *range(first, len(token_ids), chunk)]:
            stop = first if start == 0 and first > 0 else min(start + chunk, len(token_ids))
            self.executor.ctx = StepContext(-1, batch, EventLog(-1), is_exact_baseline=True)
            was_verified, reader.is_checksum_verified = reader.is_checksum_verified, True
            try:
                with torch.inference_mode():
                    keep = 1 if stop <= first else 0  # 0: every position of the pass
                    part = ids[:, start:stop]
                    logits = self.runner.model(input_ids=part, cache=cache, use_cache=True, logits_to_keep=keep)
            finally:
                self.executor.ctx = None
                reader.is_checksum_verified = was_verified
            if stop > first:
                yield logits.logits[0].float()

    def exact_logits(self, token_ids: list[int], num_chunked: int = 0) -> torch.Tensor:
        """Exact baseline: every expert at full precision, teacher-forced, transformers' own cache.

        One prefill pass by default; with `num_chunked` > 0 the last `num_chunked` tokens are fed one at
        a time instead (the exact-vs-exact control: same math, other kernel shapes). Experts are read from
        the checkpoint files and always checked against the manifest, even when serving has that check off.
        """
        batch = ForwardBatch(["audit"], [0], [len(token_ids)], torch.zeros(len(token_ids), dtype=torch.long), ["audit"])
        self.executor.ctx = StepContext(-1, batch, EventLog(-1), is_exact_baseline=True)
        ids = torch.tensor([token_ids], device=self.device)
        split = len(token_ids) - num_chunked
        reader = self.executor.expert_store.reader
        was_verified, reader.is_checksum_verified = reader.is_checksum_verified, True  # never trust an unchecked read
        try:
            with torch.inference_mode():
                if not num_chunked:
                    return self.runner.model(input_ids=ids, use_cache=False).logits[0].float()
                cache = DynamicCache(config=self.runner.model.config)
                parts = [self.runner.model(input_ids=ids[:, :split], cache=cache, use_cache=True).logits[0]]
                for i in range(split, len(token_ids)):
                    parts.append(self.runner.model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits[0])
                return torch.cat(parts).float()
        finally:
            self.executor.ctx = None
            reader.is_checksum_verified = was_verified
