"""Replays and audits of adopted prefixes: a rebuild pass after the step's KV reads spills nothing they
resolved, the replay recomputes an adopted prefix from tokens, and an adopted prefix rebuilt in the adopter's
first step passes the audit."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import pytest
import torch

from fallbackgate.assembly import Overrides, assemble
from fallbackgate.audit.replay import replay_logits
from fallbackgate.audit.replay_trace import ADOPTED_PREFIX_STEP, Segment, TraceError, load_trace
from fallbackgate.batch.demo import DEMO_POLICY
from fallbackgate.batch.prompts import load_prompts
from fallbackgate.batch.session import RunSettings
from fallbackgate.bench.prefix_reuse import spill_kept
from fallbackgate.cli import main
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Decision
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import open_ledger
from fallbackgate.policy.apply import with_sections
from fallbackgate.policy.loader import load_policy
from fallbackgate.recording import record_and_judge
from fallbackgate.tinymoe import CHECKPOINT_DIR


@pytest.mark.slow
def test_a_rebuild_pass_spills_no_block_the_step_already_resolved(tmp_path: pathlib.Path) -> None:
    """A drop-preempted request's rebuild forward runs after the step's KV reads were resolved: making room
    in it must not spill the other requests' blocks (found with turns added at random steps, demo budget)."""
    prompts = tmp_path / "mt.jsonl"
    assert main(["workload", "multi-turn", "--out", str(prompts), "--seed", "1", "--num-requests", "6"]) == 0
    policy = with_sections(load_policy(str(DEMO_POLICY)), {"memory": {"prefix_reuse": False}})
    engine = assemble(policy, Overrides()).engine
    rng, queue = random.Random(5), load_prompts(str(prompts))
    try:
        while queue or engine.has_unfinished():
            if queue and (not engine.has_unfinished() or rng.random() < 0.15):
                spec = queue.pop(0)
                params = SamplingParams(max_new_tokens=spec.max_new_tokens)
                engine.add_request(engine.tokenizer.encode(spec.prompt), params, spec.request_id)
            if engine.has_unfinished():
                engine.step()  # raised "read but neither on device nor staged" before the rebuild pinned the step
    finally:
        engine.close()
    assert len(engine.finished) == 6


def test_the_replay_recomputes_an_adopted_prefix_from_tokens(tmp_path: pathlib.Path) -> None:
    """A request whose first step starts after adopted blocks is replayed from position 0 (the adopted
    prefix recomputed from tokens, no step's actions on it): its greedy tokens come back. Before, the replay
    refused it ("starts at position N but only 0 were computed"), so an adopted request that later took an
    approximate action failed its audit."""
    prompts = tmp_path / "mt.jsonl"
    assert main(["workload", "multi-turn", "--out", str(prompts), "--seed", "1", "--num-requests", "4"]) == 0
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), device_budget_bytes=64 << 20, host_budget_bytes=0, seed=0)
    engine = Engine(config, ExactLRUController())
    settings = RunSettings(model_dir=str(CHECKPOINT_DIR), max_new_tokens=16, seed=0)
    recorded = record_and_judge(engine, load_prompts(str(prompts)), str(tmp_path / "l.db"), settings=settings)
    adopted = [o for o in recorded.outcome.outputs if o.num_reused_tokens]
    assert adopted, "no request adopted a kept prefix"
    with open_ledger(str(tmp_path / "l.db"), read_only=True) as ledger:
        trace = load_trace(ledger, recorded.run_id, adopted[0].request_id)
    assert trace.segments[0] == Segment(ADOPTED_PREFIX_STEP, 0, adopted[0].num_reused_tokens, is_sampled=False)
    logits = torch.cat(list(replay_logits(engine, trace)))
    engine.close()
    assert logits.argmax(-1).tolist() == adopted[0].output_token_ids
    own = dataclasses.replace(trace, segments=trace.segments[1:])  # the request's own steps only: refused
    with pytest.raises(TraceError, match="only 0 were computed"):
        list(replay_logits(engine, own))


class _RebuildsMisses(ExactLRUController):
    """Rebuilds every off-device KV block instead of reading its copy (what joint's arbitration chooses when
    the exact copy would arrive late)."""

    def kv_action(self, miss):
        return Decision(Tag.RECOMPUTE, reason="rebuilt instead of read")


def test_an_adopted_prefix_rebuilt_in_the_adopters_first_step_passes_the_audit(tmp_path: pathlib.Path) -> None:
    """Kept prefix blocks spilled to disk before each turn, then adopted and rebuilt (recompute) in the
    adopter's first step: the audit counts adopted positions as computed before that step. Before, the KV
    reconciliation said "recompute … of blocks [0, …], which held no computed position before the step"
    (found in a 32-request multi-turn run of the demo policy with the measured profile: 2 of 32 failed)."""
    prompts = tmp_path / "mt.jsonl"
    assert main(["workload", "multi-turn", "--out", str(prompts), "--seed", "1", "--num-requests", "4"]) == 0
    budget = {"device_budget_bytes": 64 << 20, "host_budget_bytes": 0}
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), seed=0, spill_dir=str(tmp_path), **budget)
    engine = Engine(config, _RebuildsMisses())
    add_request = engine.add_request

    def add_after_spilling(*args, **kwargs):
        spill_kept(engine)
        return add_request(*args, **kwargs)

    engine.add_request = add_after_spilling
    settings = RunSettings(model_dir=str(CHECKPOINT_DIR), max_new_tokens=16, seed=0)
    recorded = record_and_judge(engine, load_prompts(str(prompts)), str(tmp_path / "l.db"), settings=settings)
    rebuilt = [o for o in recorded.outcome.outputs if o.num_reused_tokens and o.tag_counts.get("recompute")]
    assert rebuilt, [(o.request_id, o.num_reused_tokens, o.tag_counts) for o in recorded.outcome.outputs]
    assert [(v.request_id, v.reasons) for v in recorded.verdict.requests if not v.passed] == []
