"""One request's state inside the engine."""

from __future__ import annotations

import dataclasses
import enum
import time

import torch

from fallbackgate.engine.errors import PromptError


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability and the top-k alternatives (log-softmax of its fp32 logits)."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top_ids: tuple[int, ...]  # the k most probable tokens, most probable first
    top_logprobs: tuple[float, ...]  # their log-probabilities


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet
    RUNNING = "running"  # holds device KV (at least its tail blocks)
    SWAPPED = "swapped"  # preempted; KV copies on host/disk, or dropped for recompute
    FINISHED = "finished"


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How the next token is chosen."""

    max_new_tokens: int = 32  # output tokens at most
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass
    seed: int | None = None  # per-request seed (seeded sampling)
    stop_token_ids: tuple[int, ...] = ()  # end generation on these tokens
    num_top_logprobs: int | None = None  # k (>= 0): each output token's log-probability and the top-k, computed
    # when sampled (the full row is not kept); None: none
    num_prompt_logprobs: int | None = None  # k (>= 0): each prompt token after the first gets its log-probability
    # and the top-k, computed at prefill from the position before it (the rows are not kept); None: none

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("num_top_logprobs", "num_prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")


@dataclasses.dataclass(slots=True)
class Sequence:
    """A request: its tokens, how many have KV in the store, and its timings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    request_class: str = "default"
    session_id: str | None = None  # a client-declared session: later requests may continue this one's text
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    is_logits_kept: bool = True  # False: output logits dropped at the end (only `output_logprobs`, when asked)
    has_off_device_kv: bool = False  # read a KV block that was not resident: its logits are kept (audit by risk)
    output_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)  # kept rows, one per output token
    output_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # when num_top_logprobs is set
    prompt_logprobs: dict[int, TokenLogprobs] = dataclasses.field(default_factory=dict)  # prompt position p -> the
    # log-probability of the token at p + 1 (when num_prompt_logprobs is set; a re-prefill overwrites)
    num_computed_tokens: int = 0  # tokens whose KV is in the store
    num_recompute_tokens: int = 0  # tokens computed before a drop-preemption, to be rebuilt
    num_reused_tokens: int = 0  # prompt tokens whose KV was adopted from kept prefix blocks (prefill skipped)
    num_preemptions: int = 0
    arrival_s: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_s: float = 0.0
    finish_s: float = 0.0
    modeled_arrival_s: float = 0.0  # engine modeled clock at arrival
    modeled_first_token_s: float = 0.0
    modeled_finish_s: float = 0.0
    tag_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    generator: torch.Generator | None = None
    num_scored_tokens: int = 0  # keep the prefill logits of the last this-many prompt positions (scoring)
    prompt_logits: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # position -> fp32 logits

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def pop_prompt_logits(self) -> torch.Tensor | None:
        """The kept prefill logits [num_scored_tokens, vocab] in position order, released from the sequence."""
        if not self.num_scored_tokens:
            return None
        stacked = torch.stack([self.prompt_logits[p] for p in self.scored_positions])
        self.prompt_logits = {}
        return stacked

    def pop_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The log-probabilities of prompt tokens 1.. in order (None unless asked), released from the sequence."""
        if self.params.num_prompt_logprobs is None:
            return None
        kept, self.prompt_logprobs = self.prompt_logprobs, {}
        positions = range(len(self.prompt_token_ids) - 1)
        return [kept[p] for p in positions] if all(p in kept for p in positions) else None  # None: ended unfilled

    @property
    def scored_positions(self) -> range:
        """Prompt positions whose prefill logits are kept: the last `num_scored_tokens` (the last one predicts
        the first output token)."""
        end = len(self.prompt_token_ids)
        return range(end - self.num_scored_tokens, end)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to feed before the next token can be sampled (prompt chunks, or the last output)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def check_prompt(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    limit: int,
    vocab: int,
    num_scored_tokens: int = 0,
) -> None:
    """Refuse an unusable prompt with a message naming the request and what is wrong."""
    if not prompt_token_ids:
        raise PromptError(f"request {request_id!r}: the prompt is empty")
    if len(prompt_token_ids) + params.max_new_tokens > limit:
        raise PromptError(
            f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_new_tokens "
            f"({params.max_new_tokens}) exceeds the model length limit {limit}"
        )
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise PromptError(f"request {request_id!r}: token ids must be in [0, {vocab})")
    if not 0 <= num_scored_tokens <= len(prompt_token_ids):
        raise PromptError(
            f"request {request_id!r}: num_scored_tokens must be in [0, {len(prompt_token_ids)}] "
            f"(prompt of {len(prompt_token_ids)} tokens), got {num_scored_tokens}"
        )
