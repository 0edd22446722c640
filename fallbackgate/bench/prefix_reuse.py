"""python -m fallbackgate.bench.prefix_reuse [--num-requests N] [--seed S] [--spill] [--stagger K] --json FILE

Prefix reuse on the multi-turn workload (``fallbackgate workload multi-turn``) with the bundled model, on one
schedule both ways: each session's first turn at once, each later turn when the turn before it ended
(``--stagger K``: instead one request every K engine steps in the workload's order, whatever is still
running, so turns and sessions overlap and adopt blocks of requests that still run). Run with
reuse off, then on (``--spill``: every kept block is spilled to disk before a turn is added, so reuse reads it
``exact_load`` from the spill): tokens fed (prefill chunks and decodes), blocks reused (from RAM and from the
spill), prefill tokens skipped, wall seconds, and whether the greedy tokens are equal. Exit status 1 when they
are not.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.prefix_cache import PREFIX_ID
from fallbackgate.engine.messages import Event, KVCopyChange, RequestOutput
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.workloads.build import generate, prompt_specs
from fallbackgate.workloads.kinds import Context, WorkloadKind
from fallbackgate.workloads.text import TextPool
from fallbackgate.workloads.tokens import ModelTokens


def session_specs(num_requests: int, seed: int, limit: int) -> list[PromptSpec]:
    """The multi-turn workload's requests (bundled text only, lengths as fractions of `limit`)."""
    tokens = ModelTokens(CHECKPOINT_DIR)
    ctx = Context(tokens, TextPool.load(tokens, None), limit)
    return prompt_specs(generate(ctx, WorkloadKind.MULTI_TURN, seed, num_requests, None))


def make_engine(spill_dir: str, is_reused: bool) -> Engine:
    """The bundled model on the CPU, everything in RAM, exact-only controller."""
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), device="cpu", spill_dir=spill_dir, is_prefix_reused=is_reused)
    return Engine(config, ExactLRUController())


def run_sessions(
    engine: Engine, specs: list[PromptSpec], before_turn: Callable[[Engine], None] | None = None
) -> tuple[dict[str, RequestOutput], dict[str, int], list[Event], list[KVCopyChange]]:
    """Each session's first turn at once, each later turn when the one before it ended; returns (request id ->
    output, request id -> tokens fed, every event, every KV copy change)."""
    turns: dict[str | None, collections.deque[PromptSpec]] = collections.defaultdict(collections.deque)
    for spec in specs:
        turns[spec.session].append(spec)

    def add(spec: PromptSpec) -> None:
        if before_turn is not None:
            before_turn(engine)
        params = SamplingParams(max_new_tokens=spec.max_new_tokens or 16)
        engine.add_request(engine.tokenizer.encode(spec.prompt), params, spec.request_id)

    session_of = {s.request_id: s.session for s in specs}
    for queue in turns.values():
        add(queue.popleft())
    fed: collections.Counter[str] = collections.Counter()
    events: list[Event] = []
    copies: list[KVCopyChange] = []
    while engine.has_unfinished():
        result = engine.step()
        assert engine.last_plan is not None
        fed.update(engine.last_plan.num_tokens)
        events += result.events
        copies += result.kv_copies
        for rid in result.finished_ids:
            if turns[session_of[rid]]:
                add(turns[session_of[rid]].popleft())
    return {s.request_id: engine.finished[s.request_id] for s in specs}, dict(fed), events, copies


def run_staggered(
    engine: Engine, specs: list[PromptSpec], every: int
) -> tuple[dict[str, RequestOutput], dict[str, int], list[Event], list[KVCopyChange]]:
    """One request every `every` engine steps, in order, while earlier ones still run; returns what
    `run_sessions` does."""
    queue = collections.deque(specs)
    fed: collections.Counter[str] = collections.Counter()
    events: list[Event] = []
    copies: list[KVCopyChange] = []
    step = 0
    while queue or engine.has_unfinished():
        if queue and (step % every == 0 or not engine.has_unfinished()):
            spec = queue.popleft()
            params = SamplingParams(max_new_tokens=spec.max_new_tokens or 16)
            engine.add_request(engine.tokenizer.encode(spec.prompt), params, spec.request_id)
        step += 1
        result = engine.step()
        assert engine.last_plan is not None
        fed.update(engine.last_plan.num_tokens)
        events += result.events
        copies += result.kv_copies
    return {s.request_id: engine.finished[s.request_id] for s in specs}, dict(fed), events, copies


def spill_kept(engine: Engine) -> None:
    """Spill every kept prefix block to disk (what a controller does to a cold prefix under pressure)."""
    for rid in [r for r in engine.kv_store.tables if r.startswith(PREFIX_ID)]:
        for layer in range(engine.kv_store.num_layers):
            engine.executor.spill_kv((rid, layer, 0), SpillMode.DISK_FULL)


def measure(num_requests: int, seed: int, limit: int, is_spilled: bool, stagger: int = 0) -> dict[str, Any]:
    """Reuse off, then on, on the same schedule (`stagger` > 0: one request every `stagger` steps)."""
    specs = session_specs(num_requests, seed, limit)
    out: dict[str, Any] = {"num_requests": len(specs), "seed": seed, "limit": limit, "spilled": is_spilled,
                           "stagger": stagger}  # fmt: skip
    tokens = {}
    with tempfile.TemporaryDirectory() as tmp:
        for is_reused in (False, True):
            engine = make_engine(tmp, is_reused)
            started = time.perf_counter()
            if stagger:
                outputs, fed, _, _ = run_staggered(engine, specs, stagger)
            else:
                outputs, fed, _, _ = run_sessions(engine, specs, spill_kept if is_reused and is_spilled else None)
            name = "on" if is_reused else "off"
            out[name] = {"wall_s": time.perf_counter() - started, "tokens_fed": sum(fed.values())}
            if is_reused:
                out[name] |= engine.prefix.summary()
            tokens[name] = {r: o.output_token_ids for r, o in outputs.items()}
            engine.close()
    out["prefill_tokens_skipped"] = out["off"]["tokens_fed"] - out["on"]["tokens_fed"]
    out["tokens_equal"] = tokens["on"] == tokens["off"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.prefix_reuse", description=__doc__)
    p.add_argument("--num-requests", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=1024, help="the workload's length limit (the bundled model's)")
    p.add_argument("--spill", action="store_true", help="spill every kept block before each turn")
    p.add_argument("--stagger", type=int, default=0, help="one request every K steps instead of turn by turn")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.stagger and args.spill:
        p.error("--spill applies to the turn-by-turn schedule only")
    result = measure(args.num_requests, args.seed, args.limit, args.spill, args.stagger)
    on = result["on"]
    print(
        f"prefix reuse on {result['num_requests']} multi-turn requests: {on['num_reused_blocks']} blocks reused "
        f"({on.get('num_shared_blocks', 0)} from requests still running; {on['num_reused_resident']} layer blocks "
        f"resident, {on['num_reused_spilled']} exact_load from the spill), "
        f"{result['prefill_tokens_skipped']} of {result['off']['tokens_fed']} tokens fed skipped; "
        f"wall {result['off']['wall_s']:.2f} s -> {on['wall_s']:.2f} s; tokens equal: {result['tokens_equal']}"
    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0 if result["tokens_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
