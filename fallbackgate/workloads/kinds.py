"""The workload kinds, one generator each, registered per :class:`WorkloadKind` with :func:`register_kind`.

Every length is a fraction of the model's length limit ``L`` in its own tokens; a generator returns
:class:`Request` objects whose prompt plus answer fit ``L``. Requests carry their arrival times; a session's
turns extend one growing prompt (each turn's prompt starts with the previous turn's whole prompt, token for
token).
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable

from fallbackgate.workloads.arrivals import TurnTiming, next_turn_arrival_s, poisson_arrivals
from fallbackgate.workloads.text import TextPool
from fallbackgate.workloads.tokens import ModelTokens


class WorkloadKind(str, enum.Enum):
    """The workloads ``fallbackgate workload`` writes (the probe's four, and their mix)."""

    SHORT_CHAT = "short-chat"
    LONG_RETRIEVAL = "long-retrieval"
    MULTI_TURN = "multi-turn"
    LONG_REASONING = "long-reasoning"
    MIXED = "mixed"


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One generated request."""

    kind: WorkloadKind
    prompt: str
    prompt_tokens: int  # in the model's tokens, as the engine counts them
    max_new_tokens: int
    arrival_s: float
    session: int | None = None  # multi-turn: the session's number within the workload
    turn: int | None = None  # multi-turn: from 0


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """What every generator draws on."""

    tokens: ModelTokens
    text: TextPool
    limit: int  # the model's length limit L (prompt + output tokens)
    timing: TurnTiming = TurnTiming()
    num_phases: int = 4  # the mixed workload's phases


Generate = Callable[[Context, random.Random, int, float, float], list[Request]]
"""(context, rng, number of requests, arrival rate per second, start time) -> requests."""


@dataclasses.dataclass(frozen=True, slots=True)
class KindEntry:
    """A registered kind."""

    generate: Generate
    rate_per_s: float  # default arrival rate (multi-turn: of sessions)
    about: str  # one line for --help


_REGISTRY: dict[WorkloadKind, KindEntry] = {}


def register_kind(kind: WorkloadKind, rate_per_s: float, about: str) -> Callable[[Generate], Generate]:
    """Function decorator: register the generator of `kind` with its default rate and description."""

    def register(generate: Generate) -> Generate:
        if kind in _REGISTRY:
            raise ValueError(f"workload kind {kind.value!r} is already registered")
        _REGISTRY[kind] = KindEntry(generate, rate_per_s, about)
        return generate

    return register


def kind_entry(kind: WorkloadKind | str) -> KindEntry:
    """The registration of `kind` (a KeyError naming the registered kinds when there is none)."""
    kind = WorkloadKind(kind)
    if kind not in _REGISTRY:
        raise KeyError(f"no generator registered for {kind.value!r} (registered: {[k.value for k in _REGISTRY]})")
    return _REGISTRY[kind]


def registered_kinds() -> tuple[WorkloadKind, ...]:
    """The registered kinds, in :class:`WorkloadKind` order."""
    return tuple(k for k in WorkloadKind if k in _REGISTRY)


def tokens_between(rng: random.Random, limit: int, low: float, high: float) -> int:
    """A length drawn uniformly between the fractions `low` and `high` of `limit`, at least 1."""
    return max(1, round(rng.uniform(low, high) * limit))


def fit_prompt(tokens: ModelTokens, frame: Callable[[str], str], body: str, budget: int) -> tuple[str, int]:
    """``frame(body)`` with `body` cut until the prompt has at most `budget` tokens; (prompt, its tokens)."""
    prompt = frame(body)
    count = tokens.count(prompt)
    while count > budget:
        if not body:
            raise ValueError(f"the prompt's frame alone has {count} tokens, more than {budget}")
        body = tokens.head(body, tokens.count_plain(body) - (count - budget))
        prompt = frame(body)
        count = tokens.count(prompt)
    return prompt, count


def framed_prompt(ctx: Context, rng: random.Random, frame: Callable[[str], str], target: int) -> tuple[str, int]:
    """A prompt of about `target` tokens (at most, unless the frame needs more): `frame` around running text
    of at least one token."""
    frame_tokens = ctx.tokens.count(frame(""))
    body = ctx.text.passage(rng, max(1, target - frame_tokens))
    return fit_prompt(ctx.tokens, frame, body, max(target, frame_tokens + 1))


# --- the probe's four kinds ----------------------------------------------------------------------------------
CHAT_PROMPT, CHAT_ANSWER = (0.01, 0.08), (0.02, 0.12)
RETRIEVAL_ANSWER, RETRIEVAL_QUESTION = (0.01, 0.04), (0.01, 0.03)
RETRIEVAL_PROMPT = (0.85, 1.0)  # of the room the answer leaves: L - answer
TOOL_FIRST, TOOL_RESULT, TOOL_USER, TOOL_ANSWER = (0.05, 0.15), (0.03, 0.10), (0.01, 0.03), (0.02, 0.06)
TURNS_PER_SESSION = (2, 8)  # a session ends earlier when its next turn would not fit L
REASONING_PROMPT, REASONING_ANSWER = (0.01, 0.05), (0.25, 0.5)


@register_kind(WorkloadKind.SHORT_CHAT, 4.0, "short prompts, short answers (Poisson arrivals)")
def short_chat(ctx: Context, rng: random.Random, count: int, rate_per_s: float, start_s: float) -> list[Request]:
    """Prompts of 1-8 % of L, answers of 2-12 % of L."""
    requests = []
    for arrival in poisson_arrivals(rng, count, rate_per_s, start_s):
        target, answer = tokens_between(rng, ctx.limit, *CHAT_PROMPT), tokens_between(rng, ctx.limit, *CHAT_ANSWER)
        prompt, num = framed_prompt(ctx, rng, lambda body: f"User: {body}\nAssistant:", target)
        requests.append(Request(WorkloadKind.SHORT_CHAT, prompt, num, answer, arrival))
    return requests


@register_kind(WorkloadKind.LONG_RETRIEVAL, 0.5, "documents filling the limit, short answers (Poisson arrivals)")
def long_retrieval(ctx: Context, rng: random.Random, count: int, rate_per_s: float, start_s: float) -> list[Request]:
    """Answers of 1-4 % of L; prompts of 85-100 % of the rest: documents, then a question."""
    requests = []
    for arrival in poisson_arrivals(rng, count, rate_per_s, start_s):
        answer = tokens_between(rng, ctx.limit, *RETRIEVAL_ANSWER)
        target = tokens_between(rng, ctx.limit - answer, *RETRIEVAL_PROMPT)
        question = ctx.text.passage(rng, tokens_between(rng, ctx.limit, *RETRIEVAL_QUESTION))
        documents = "\n\n".join(f"Document {i + 1}: {p}" for i, p in enumerate(ctx.text.pieces(rng, target)))

        def frame(body: str, question: str = question) -> str:
            return f"Answer from the documents.\n\n{body}\n\nQuestion: {question}\nAnswer:"

        prompt, num = fit_prompt(ctx.tokens, frame, documents, target)
        requests.append(Request(WorkloadKind.LONG_RETRIEVAL, prompt, num, answer, arrival))
    return requests


@register_kind(WorkloadKind.MULTI_TURN, 0.25, "tool-use sessions whose turns extend one growing prompt")
def multi_turn(ctx: Context, rng: random.Random, count: int, rate_per_s: float, start_s: float) -> list[Request]:
    """Sessions of 2-8 turns (Poisson starts). Turn 0: a system line, a tool result of 5-15 % of L and a user
    line; each later turn appends the previous answer (its expected length), a tool result of 3-10 % and a
    user line of 1-3 % of L; answers of 2-6 % of L. A turn arrives after the previous one's expected finish
    plus a think time."""
    requests: list[Request] = []
    session, session_start = 0, start_s
    while len(requests) < count:
        session_start += rng.expovariate(rate_per_s)
        arrival = session_start
        prompt, ids = "System: you answer with the help of a search tool.", ctx.tokens.ids("")
        tool_tokens = tokens_between(rng, ctx.limit, *TOOL_FIRST)
        for turn in range(rng.randint(*TURNS_PER_SESSION)):
            answer = tokens_between(rng, ctx.limit, *TOOL_ANSWER)
            previous_answer = "" if turn == 0 else " " + ctx.text.passage(rng, requests[-1].max_new_tokens)
            tool = ctx.text.passage(rng, tool_tokens)
            user = ctx.text.passage(rng, tokens_between(rng, ctx.limit, *TOOL_USER))
            extended = f"{prompt}{previous_answer}\nTool result: {tool}\nUser: {user}\nAssistant:"
            extended_ids = ctx.tokens.ids(extended)
            if len(extended_ids) + answer > ctx.limit:
                if turn == 0:
                    raise ValueError(f"a first turn of {len(extended_ids)} + {answer} tokens exceeds {ctx.limit}")
                break
            if extended_ids[: len(ids)] != ids:
                raise ValueError("the tokenizer merges tokens across a turn boundary: no shared prefix")
            if turn:
                previous = requests[-1]
                arrival = next_turn_arrival_s(
                    rng, previous.arrival_s, previous.prompt_tokens, previous.max_new_tokens, ctx.timing
                )
            requests.append(
                Request(WorkloadKind.MULTI_TURN, extended, len(extended_ids), answer, arrival, session, turn)
            )
            prompt, ids = extended, extended_ids
            tool_tokens = tokens_between(rng, ctx.limit, *TOOL_RESULT)
            if len(requests) == count:
                break
        session += 1
    return requests


@register_kind(WorkloadKind.LONG_REASONING, 0.5, "short prompts, answers up to half the limit (Poisson arrivals)")
def long_reasoning(ctx: Context, rng: random.Random, count: int, rate_per_s: float, start_s: float) -> list[Request]:
    """Prompts of 1-5 % of L, answers of 25-50 % of L."""
    requests = []
    for arrival in poisson_arrivals(rng, count, rate_per_s, start_s):
        target = tokens_between(rng, ctx.limit, *REASONING_PROMPT)
        answer = min(tokens_between(rng, ctx.limit, *REASONING_ANSWER), ctx.limit // 2)
        prompt, num = framed_prompt(ctx, rng, lambda body: f"Question: {body}\nReasoning:", target)
        requests.append(Request(WorkloadKind.LONG_REASONING, prompt, num, answer, arrival))
    return requests
