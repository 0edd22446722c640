"""A whole workload: generated from its seed, checked against the model's limit, written as a prompts file.

The file is the JSONL that ``fallbackgate run --prompts`` reads (:mod:`fallbackgate.batch.prompts`): per line
`id`, `arrival_s` (seconds from the start), `max_new_tokens`, `prompt`, optional `class`, and for a turn of
a multi-turn session `session` and `turn`; lines in arrival order. The same kind, seed, model, limit and
text sources give the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.workloads.kinds import Context, Request, WorkloadKind, kind_entry
from fallbackgate.workloads.mixed import PHASE_KINDS

ARRIVAL_DECIMALS = 6  # arrival_s is written to the microsecond


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """The generated requests, in arrival order, and how they were made."""

    kind: WorkloadKind
    seed: int
    limit: int
    requests: list[Request]


def generate(ctx: Context, kind: WorkloadKind, seed: int, num_requests: int, rate_per_s: float | None) -> Workload:
    """`num_requests` requests of `kind` from `seed` (`rate_per_s`: None for the kind's default rate); a
    ValueError when a request would not fit the limit."""
    entry = kind_entry(kind)
    rng = random.Random(f"fallbackgate-workload:{kind.value}:{seed}")
    requests = entry.generate(ctx, rng, num_requests, rate_per_s or entry.rate_per_s, 0.0)
    rounded = [dataclasses.replace(r, arrival_s=round(r.arrival_s, ARRIVAL_DECIMALS)) for r in requests]
    ordered = sorted(rounded, key=lambda r: r.arrival_s)  # stable: a session's turns keep their order
    for request in ordered:
        if request.prompt_tokens + request.max_new_tokens > ctx.limit:
            raise ValueError(
                f"a {request.kind.value} request of {request.prompt_tokens} + {request.max_new_tokens} tokens "
                f"exceeds the limit of {ctx.limit}"
            )
    return Workload(kind, seed, ctx.limit, ordered)


def prompt_specs(workload: Workload, request_class: str = "default") -> list[PromptSpec]:
    """The requests as prompts-file entries: ids `<kind>-<n>`, turns `<kind>-s<session>-t<turn>`."""
    counters: dict[WorkloadKind, int] = {}
    specs = []
    for r in workload.requests:
        session = None if r.session is None else f"{r.kind.value}-s{r.session:04d}"
        if session is not None:
            request_id = f"{session}-t{r.turn}"
        else:
            request_id = f"{r.kind.value}-{counters.setdefault(r.kind, 0):04d}"
            counters[r.kind] += 1
        specs.append(PromptSpec(r.prompt, request_id, request_class, r.max_new_tokens, r.arrival_s, session, r.turn))
    return specs


def to_jsonl(specs: list[PromptSpec]) -> str:
    """The prompts file's text (`class` written only when not "default")."""
    lines = []
    for spec in specs:
        item: dict[str, object] = {"id": spec.request_id}
        if spec.request_class != "default":
            item["class"] = spec.request_class
        item["arrival_s"] = spec.arrival_s
        if spec.session is not None:
            item |= {"session": spec.session, "turn": spec.turn}
        item |= {"max_new_tokens": spec.max_new_tokens, "prompt": spec.prompt}
        lines.append(json.dumps(item, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _quantiles(values: list[int]) -> str:
    cuts = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return f"min {min(values)}  p50 {round(cuts[4])}  p90 {round(cuts[8])}  max {max(values)}"


def summary_lines(workload: Workload, sources: list[str]) -> list[str]:
    """What the command prints after writing: counts, token quantiles (and as fractions of the limit), time."""
    requests, limit = workload.requests, workload.limit
    prompts, outputs = [r.prompt_tokens for r in requests], [r.max_new_tokens for r in requests]
    duration = requests[-1].arrival_s
    lines = [
        f"  requests: {len(requests)} over {duration:.1f} s ({len(requests) / max(duration, 1e-9):.2f}/s)",
        f"  prompt tokens: {_quantiles(prompts)} (max {max(prompts) / limit:.0%} of the limit)",
        f"  output tokens: {_quantiles(outputs)} (max {max(outputs) / limit:.0%} of the limit)",
        f"  largest request: {max(p + o for p, o in zip(prompts, outputs, strict=True))} of {limit} tokens",
    ]
    sessions = {r.session for r in requests if r.session is not None}
    if sessions:
        lines.append(f"  sessions: {len(sessions)}, {sum(r.session is not None for r in requests)} turns")
    if workload.kind is WorkloadKind.MIXED:
        kinds = [k.value for k in PHASE_KINDS]
        lines.append("  by kind: " + ", ".join(f"{k} {sum(r.kind.value == k for r in requests)}" for k in kinds))
    return lines + [f"  text: {source}" for source in sources]
