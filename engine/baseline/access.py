"""What audits need from an engine: its dense weights checked, and exact-baseline computations.

A mixin of :class:`fallbackgate.engine.engine.Engine`; every method reads the checkpoint files (through the
audit's own verified cache) and never the stores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from fallbackgate.engine.experts.integrity import verify_dense
from fallbackgate.engine.messages import Verification

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fallbackgate.engine.model.runner import ModelRunner


class AuditAccess:
    """Exact-baseline entry points over the engine's model runner."""

    runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase | None
    dense_digests: dict[str, str]

    def verify_dense(self) -> list[Verification]:
        """Check every dense weight against the digest of what the loader read from the checkpoint."""
        return verify_dense(self.runner.model, self.dense_digests)

    def exact_hidden(self, sequences: list[list[int]]) -> torch.Tensor:
        """Exact-baseline final hidden states [B, L, H] of several sequences in one batched pass."""
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else None
        return self.runner.exact_hidden(sequences, pad if pad is not None else 0)

    def exact_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of exact-baseline hidden states [N, H]."""
        return self.runner.exact_head(hidden)

    def exact_chunks(self, token_ids: list[int], first: int, chunk: int) -> Iterator[torch.Tensor]:
        """Exact-baseline logits at positions first.. as [<= chunk, vocab] chunks (bounded audit memory)."""
        return self.runner.exact_chunks(token_ids, first, chunk)

    def exact_logits(self, token_ids: list[int], num_chunked: int = 0) -> torch.Tensor:
        """Exact-baseline logits [len, vocab] for a token sequence (the audit's teacher-forced pass)."""
        return self.runner.exact_logits(token_ids, num_chunked)
