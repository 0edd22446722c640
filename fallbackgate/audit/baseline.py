"""The exact baseline of a group of requests: batched passes, logits made chunk by chunk.

Requests are teacher-forced together, right-padded, in passes of at most BATCH_TOKENS padded tokens: each
routed expert is read once per layer per pass (from the checkpoint files, through the audit's own
verified cache) rather than once per request. Only final hidden states are kept; full-vocabulary logits
exist for at most one chunk of positions at a time.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.baseline.api import BaselineEngine

BATCH_TOKENS = 8192  # padded tokens per batched baseline pass


class Baseline:
    """Exact-baseline logits at the output positions of several (prompt ids, output ids) requests."""

    def __init__(self, engine: BaselineEngine, requests: list[tuple[list[int], list[int]]]) -> None:
        self.engine = engine
        self.first = [len(prompt) - 1 for prompt, _ in requests]  # position producing output token 0
        self.where: list[tuple[int, int]] = []  # request -> (pass, row)
        self.hidden: list[torch.Tensor] = []  # per pass [B, L, H]
        sequences = [list(prompt) + list(output[:-1]) for prompt, output in requests]
        group: list[int] = []
        for index, tokens in enumerate(sequences):
            longest = max([len(tokens), *(len(sequences[i]) for i in group)])
            if group and longest * (len(group) + 1) > BATCH_TOKENS:
                self._pass(sequences, group)
                group = []
            group.append(index)
        if group:
            self._pass(sequences, group)

    def _pass(self, sequences: list[list[int]], group: list[int]) -> None:
        self.where += [(len(self.hidden), row) for row in range(len(group))]
        self.hidden.append(self.engine.exact_hidden([sequences[i] for i in group]))

    def rows(self, index: int, start: int, stop: int) -> torch.Tensor:
        """fp32 logits [stop - start, vocab] that the baseline gives output positions start..stop of request
        `index`."""
        pass_index, row = self.where[index]
        first = self.first[index]
        return self.engine.exact_head(self.hidden[pass_index][row, first + start : first + stop])

    def of(self, index: int):  # noqa: ANN201 - a ServedRows-shaped callable
        """Request `index`'s rows as a (start, stop) -> logits callable."""
        return lambda start, stop: self.rows(index, start, stop)
