"""Batched teacher-forced scoring and generation through the engine's own (possibly degraded) path.

Scoring submits each (context + continuation)[:-1] token sequence as a request with ``max_new_tokens=1`` and
``num_scored_tokens=len(continuation)``: the engine keeps the prefill logits that predict the continuation,
so the log-likelihoods come from the same packed, budgeted forward passes — and the same fallbacks — as
served traffic. Many requests are in flight at once; the scheduler batches them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch

from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.engine.sequence import SamplingParams

StepHook = Callable[[StepPlan, StepResult], None]
FinishHook = Callable[[RequestOutput, list[int]], None]  # output, step id that computed each scored position


@dataclasses.dataclass(slots=True)
class Submission:
    """One request to run: its tokens, how many trailing tokens to score, its sampling params."""

    token_ids: list[int]
    num_scored_tokens: int = 0
    params: SamplingParams = dataclasses.field(default_factory=lambda: SamplingParams(max_new_tokens=1))


@dataclasses.dataclass(slots=True)
class Scored:
    """Log-likelihood of the scored tokens under the engine, and whether each was the argmax."""

    request_id: str
    logprob: float  # sum of log p(token) over the scored tokens
    is_greedy: bool  # every scored token was the argmax of its logits
    token_logprobs: list[float]


def score_logits(logits: torch.Tensor, targets: list[int]) -> tuple[float, bool, list[float]]:
    """(sum of log-probs, all-greedy, per-token log-probs) of `targets` under `logits` [n, vocab] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(targets, dtype=torch.long)
    picked = logp.gather(1, target[:, None])[:, 0]
    return float(picked.sum()), bool((logp.argmax(dim=-1) == target).all()), picked.tolist()


class _PositionSteps:
    """Which step computed each prompt position of each tracked request (the last one wins on re-prefill)."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[int, int]] = {}

    def track(self, request_id: str) -> None:
        self.steps[request_id] = {}

    def update(self, plan: StepPlan) -> None:
        for rid in plan.request_ids:
            if rid in self.steps:
                start = plan.start_positions[rid]
                for pos in range(start, start + plan.num_tokens[rid]):
                    self.steps[rid][pos] = plan.step_id

    def pop(self, output: RequestOutput, num_scored: int) -> list[int]:
        table = self.steps.pop(output.request_id)
        end = len(output.prompt_token_ids)
        return [table.get(p, -1) for p in range(end - num_scored, end)]


def run_requests(
    engine: Engine,
    submissions: Iterable[Submission],
    *,
    id_prefix: str,
    request_class: str = "default",
    max_in_flight: int = 64,
    on_step: StepHook | None = None,
    on_finish: FinishHook | None = None,
) -> Iterator[tuple[int, RequestOutput]]:
    """Run submissions with up to `max_in_flight` queued or running at once; yields (index, output) as each
    finishes. `on_finish` sees the output (prompt logits included) before they are released."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
    pending = iter(enumerate(submissions))
    in_flight: dict[str, tuple[int, int]] = {}  # request id -> (index, num scored)
    steps = _PositionSteps()
    exhausted = False
    while True:
        while not exhausted and len(in_flight) < max_in_flight:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            index, sub = item
            rid = engine.add_request(
                sub.token_ids,
                sub.params,
                f"{id_prefix}-{index}",
                request_class,
                num_scored_tokens=sub.num_scored_tokens,
            )
            in_flight[rid] = (index, sub.num_scored_tokens)
            steps.track(rid)
        if not in_flight:
            return
        result = engine.step()
        steps.update(engine.last_plan)
        if on_step is not None:
            on_step(engine.last_plan, result)
        for rid in result.finished_ids:
            index, num_scored = in_flight.pop(rid)
            output = engine.finished.pop(rid)
            step_ids = steps.pop(output, num_scored)
            if on_finish is not None:
                on_finish(output, step_ids)
            yield index, output


def score(
    engine: Engine,
    items: Iterable[tuple[list[int], list[int]]],
    *,
    id_prefix: str = "score",
    request_class: str = "default",
    max_in_flight: int = 64,
    on_step: StepHook | None = None,
    on_finish: FinishHook | None = None,
) -> list[Scored]:
    """Log-likelihood of each continuation after its (non-empty) context, batched through the engine, in
    input order. The last continuation token is never fed (as in a teacher-forced pass over context + cont)."""
    items = list(items)
    subs = (Submission((list(ctx) + list(cont))[:-1], len(cont)) for ctx, cont in items)
    out: list[Scored | None] = [None] * len(items)
    for index, output in run_requests(
        engine,
        subs,
        id_prefix=id_prefix,
        request_class=request_class,
        max_in_flight=max_in_flight,
        on_step=on_step,
        on_finish=on_finish,
    ):
        assert output.prompt_logits is not None
        logprob, greedy, per_token = score_logits(output.prompt_logits, items[index][1])
        out[index] = Scored(output.request_id, logprob, greedy, per_token)
        output.prompt_logits = None  # release [n, vocab]
    return [s for s in out if s is not None]
