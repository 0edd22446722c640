"""No false alarms: exact-only runs on random checkpoints, prompts and tight budgets pass the gate, and runs
with forced approximate tags pass its correctness half (their replay matches what was served)."""

from __future__ import annotations

import pathlib
import sqlite3

import pytest
import torch

from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.recording import RecordedRun, record_and_judge
from tests.checkpoints import make_checkpoint
from tests.test_engine_exact import one_request_budget, sizes

WORDS = "once upon a time the quick brown fox jumps over lazy dog princess lived in castle".split()


APPROXIMATE = (
    ("expert_defer",),
    ("expert_lowbit",),
    ("kv_dequant",),
    ("kv_dequant", "recompute"),
    ("expert_defer", "kv_dequant"),
)


def _exact_only_run(seed: int, root: pathlib.Path, force: tuple[str, ...] = ()) -> RecordedRun:
    """A run on a fresh random checkpoint and prompts, at a tight budget picked by the seed; exact-only
    unless `force` turns tags on."""
    gen = torch.Generator().manual_seed(seed)
    arch = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3")[seed % 4]
    path = make_checkpoint(arch, root / f"ck-{seed}", seed=seed)
    expert, block, layers, top_k = sizes(path)
    minimum = one_request_budget(path, 24)  # the longest request (8 words + 6 tokens) alone
    knobs = [
        {"device_budget_bytes": minimum},
        {
            "device_budget_bytes": minimum + 3 * layers * block,
            "host_budget_bytes": 6 * expert,
            "is_emulated_device_tier": True,  # host copies: CUDA's layout, emulated in RAM
        },
        {"device_budget_bytes": 3 * expert + 6 * layers * block, "preempt_mode": "recompute"},
    ][seed % 3]
    if force:  # room for a dequantized low-bit copy and a staged block beside the tight budget
        knobs["device_budget_bytes"] += 2 * expert + layers * block
    config = EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, seed=seed, **knobs)
    engine = Engine(config, ExactLRUController(force))
    prompts = [
        " ".join(WORDS[i] for i in torch.randint(len(WORDS), (int(n),), generator=gen).tolist())
        for n in torch.randint(1, 9, (3,), generator=gen)
    ]
    settings = RunSettings(model_dir=str(path), max_new_tokens=6, seed=seed)
    return record_and_judge(engine, prompts, str(root / f"ledger-{seed}.sqlite"), settings=settings)


def _assert_no_false_alarm(seed: int, root: pathlib.Path) -> None:
    recorded = _exact_only_run(seed, root)
    tags = {t for o in recorded.outcome.outputs for t in o.tag_counts}
    assert recorded.verdict.passed, (seed, recorded.verdict)
    assert "exact_load" in tags and tags <= {"resident", "exact_load", "recompute"}, (seed, tags)
    assert all(v.stats["max_kl"] < 1e-9 for v in recorded.verdict.requests), seed


def _assert_replay_matches(seed: int, root: pathlib.Path) -> None:
    force = APPROXIMATE[seed % len(APPROXIMATE)]
    recorded = _exact_only_run(seed, root, force)
    tags = {t for o in recorded.outcome.outputs for t in o.tag_counts}
    assert set(force) & tags, (seed, force, tags)
    for v in recorded.verdict.requests:
        assert v.correctness_passed and not v.reasons, (seed, force, v)


@pytest.mark.parametrize("seed", [0, 1])
def test_exact_only_runs_pass_the_gate(seed: int, tmp_path: pathlib.Path) -> None:
    _assert_no_false_alarm(seed, tmp_path)


@pytest.mark.parametrize("seed", [0, 3])
def test_approximate_runs_match_their_replay(seed: int, tmp_path: pathlib.Path) -> None:
    _assert_replay_matches(seed, tmp_path)


@pytest.mark.slow
def test_no_false_alarm_over_forty_seeded_configurations(tmp_path: pathlib.Path) -> None:
    for seed in range(40):  # 4 architectures x 3 budgets, exact-only ...
        _assert_no_false_alarm(seed, tmp_path)
    for seed in range(40):  # ... and with each forced approximate tag set: the replay agrees
        _assert_replay_matches(seed, tmp_path / "approximate")


def test_a_rebuild_pass_with_every_expert_resident_is_evidence_of_its_recompute(tmp_path: pathlib.Path) -> None:
    """Forced recompute under a budget that holds every expert: each step's rebuild pass uses resident experts
    only, and those uses are the pass's own (rebuild events), so the audit finds the pass behind every
    recompute and the step's own rows count only the step's tokens."""
    path = make_checkpoint("olmoe", tmp_path / "ck", seed=3)
    expert, block, layers, top_k = sizes(path)
    config = EngineConfig(
        model_dir=str(path), block_size=4, max_num_seqs=3, seed=0, device_budget_bytes=64 * layers * (expert + block)
    )
    engine = Engine(config, ExactLRUController(("recompute",)))
    prompts = ["the cat sat on the mat and then", "a dog ran far away from the house", "one two three four"]
    settings = RunSettings(model_dir=str(path), max_new_tokens=6, seed=0)
    recorded = record_and_judge(engine, prompts, str(tmp_path / "ledger.sqlite"), settings=settings)
    assert all(o.tag_counts.get("recompute", 0) > 0 for o in recorded.outcome.outputs)
    assert [(v.request_id, v.reasons) for v in recorded.verdict.requests if not v.correctness_passed] == []
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:  # decode steps after the first rebuild
        rows = conn.execute(
            "SELECT num_tokens, rebuild_objects, resident_expert_uses FROM step_requests WHERE step_id >= 2"
        ).fetchall()
    assert rows and all(n == 1 and rebuilt > 0 for n, rebuilt, _ in rows), rows
    assert all(max(map(int, uses.split(","))) <= top_k for _, _, uses in rows), rows  # one token's top-k
