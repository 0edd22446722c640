"""Prefix reuse across turns: kept full KV blocks are adopted by later prompts with the same prefix, from RAM
(resident) or from the spill (exact_load), and the tokens equal a run without reuse on the same schedule."""

from __future__ import annotations

import dataclasses
import pathlib
import sqlite3

import pytest

from fallbackgate.audit.kv_copies import _replay_journal
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.bench import victims_reference as ref
from fallbackgate.bench.prefix_reuse import make_engine, run_sessions, spill_kept
from fallbackgate.cli import main
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.controllers.joint import JointController
from fallbackgate.controllers.joint_placement import prefix_spill_mode
from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.prefix_cache import PREFIX_ID, PrefixCache, PrefixEntryInfo, chain_hashes
from fallbackgate.engine.messages import Event, StepKind, StepPlan
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tracing import read_trace
from fallbackgate.workloads.build import generate, prompt_specs
from fallbackgate.workloads.kinds import Context, WorkloadKind
from fallbackgate.workloads.text import TextPool
from fallbackgate.workloads.tokens import ModelTokens
from tests.test_victim_order import POLICY

LIMIT = 384  # short sessions: the test's prompts stay small


@pytest.fixture(scope="module")
def sessions() -> list[PromptSpec]:
    tokens = ModelTokens(CHECKPOINT_DIR)
    ctx = Context(tokens, TextPool.load(tokens, None), LIMIT)
    return prompt_specs(generate(ctx, WorkloadKind.MULTI_TURN, 5, 6, None))


def _engine(tmp_path: pathlib.Path, is_reused: bool) -> Engine:
    return make_engine(str(tmp_path), is_reused)


def test_multi_turn_reuse_skips_prefill_with_equal_tokens(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    assert any(s.turn for s in sessions)
    plain = _engine(tmp_path / "off", False)
    off, fed_off, _, _ = run_sessions(plain, sessions)
    plain.close()
    engine = _engine(tmp_path / "on", True)
    on, fed_on, _, _ = run_sessions(engine, sessions)
    stats = engine.prefix.stats
    engine.close()
    assert {r: o.output_token_ids for r, o in on.items()} == {r: o.output_token_ids for r, o in off.items()}
    assert stats.num_reused_blocks > 0 and stats.num_reused_requests > 0
    skipped = sum(fed_off.values()) - sum(fed_on.values())
    assert skipped == stats.num_reused_tokens == sum(o.num_reused_tokens for o in on.values())
    assert all(on[s.request_id].num_reused_tokens == 0 for s in sessions if s.turn == 0)  # nothing to reuse yet
    assert stats.num_reused_resident == stats.num_reused_blocks * engine.kv_store.num_layers  # all in RAM here
    assert stats.num_reused_spilled == 0
    for spec in sessions:  # a later turn reuses at most its prompt's full blocks but the last token
        assert on[spec.request_id].num_reused_tokens <= len(on[spec.request_id].prompt_token_ids) - 1


def test_spilled_prefix_is_read_exact_load_from_disk(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    plain = _engine(tmp_path / "off", False)
    off, _, _, _ = run_sessions(plain, sessions)
    plain.close()
    engine = _engine(tmp_path / "on", True)
    on, _, events, changes = run_sessions(engine, sessions, before_turn=spill_kept)  # every kept block leaves RAM first
    stats = engine.prefix.stats
    engine.close()
    assert {r: o.output_token_ids for r, o in on.items()} == {r: o.output_token_ids for r, o in off.items()}
    layers = engine.kv_store.num_layers  # a block another session's running turn holds stays in RAM (shared)
    assert stats.num_reused_spilled + stats.num_reused_resident == stats.num_reused_blocks * layers
    assert stats.num_reused_spilled > 0 and stats.num_reused_resident == stats.num_shared_blocks * layers
    loads = [e for e in events if e.object_kind is ObjectKind.KV_BLOCK and e.tag is Tag.EXACT_LOAD]
    assert sum(e.count for e in loads if e.source_tier is Tier.DISK) >= stats.num_reused_spilled
    rows = [
        {"step_id": 0, "request_id": c.request_id, "layer": c.layer, "tier": c.tier.value, "bits": c.bits,
         "action": c.action.value, "block_ids": ",".join(map(str, c.block_ids))}
        for c in changes
    ]  # fmt: skip
    assert any(r["action"] == "moved_in" for r in rows)
    failures: list[str] = []
    _replay_journal(rows, lambda rid, text: failures.append(text))
    assert failures == []  # every read of a moved copy found it live


def test_a_corrupted_kept_block_is_not_reused(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    def corrupt(engine: Engine) -> None:
        for rid in [r for r in engine.kv_store.tables if r.startswith(PREFIX_ID)]:
            block = engine.kv_store.blocks(rid, 0)[0]
            if block.device is not None:
                block.device[0, 0, 0] += 1.0

    engine = _engine(tmp_path, True)
    run_sessions(engine, sessions, before_turn=corrupt)
    stats = engine.prefix.stats
    engine.close()
    assert stats.num_checksum_failures > 0 and stats.num_reused_blocks == 0


def test_reuse_off_keeps_nothing(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    engine = _engine(tmp_path, False)
    run_sessions(engine, sessions[:2])
    assert engine.prefix.summary()["num_kept_now"] == 0 and engine.prefix.stats.num_kept_blocks == 0
    assert set(engine.kv_store.tables) == set()
    engine.close()


def test_kept_blocks_in_ram_stay_within_the_ram_cap(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    engine = _engine(tmp_path, True)
    unbounded = run_sessions(engine, sessions)[0]
    kept = engine.prefix.summary()["num_kept_layer_blocks_on_device"]
    engine.close()
    assert kept > 4
    cap_blocks = kept // 3
    config = dataclasses.replace(engine.config, prefix_ram_cap_bytes=cap_blocks * engine.kv_store.bytes_per_block)
    capped = Engine(config, ExactLRUController())
    outputs = run_sessions(capped, sessions)[0]
    summary = capped.prefix.summary()
    capped.close()
    assert 0 < summary["num_kept_layer_blocks_on_device"] <= cap_blocks  # the least recent were dropped
    assert summary["num_dropped_blocks"] > 0
    assert {r: o.output_token_ids for r, o in outputs.items()} == {r: o.output_token_ids for r, o in unbounded.items()}


def test_hash_chain_names_the_whole_prefix() -> None:
    a = chain_hashes(list(range(40)), 8, 5, [])
    b = chain_hashes(list(range(16)) + [99] + list(range(17, 40)), 8, 5, [])
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # diverged at block 2
    known = a[:3]
    assert chain_hashes(list(range(40)), 8, 5, known) == a  # extended in place


def test_non_exact_events_taint_from_their_step(tmp_path: pathlib.Path) -> None:
    cache = PrefixCache.__new__(PrefixCache)
    cache.clean_tokens = {}
    cache.kv = type("KV", (), {"block_size": 4})()
    plan = StepPlan(step_id=3, kind=StepKind.MIXED, request_ids=["a", "b"], num_tokens={"a": 1, "b": 8},
                    start_positions={"a": 20, "b": 8})  # fmt: skip
    cache.note_events(plan, [
        Event(3, "a", 0, ObjectKind.EXPERT, Tag.EXPERT_DEFER, 1),
        Event(3, "b", 0, ObjectKind.KV_BLOCK, Tag.RECOMPUTE, 1, object_ids=[1]),
        Event(3, "b", 0, ObjectKind.EXPERT, Tag.EXACT_LOAD, 1),
    ])  # fmt: skip
    assert cache.clean_tokens == {"a": 20, "b": 4}


def test_journal_replay_refuses_a_move_in_without_a_move_out() -> None:
    row = {"step_id": 1, "request_id": "b", "layer": 0, "tier": "disk", "bits": 0, "action": "moved_in",
           "block_ids": "0"}  # fmt: skip
    failures: list[str] = []
    _replay_journal([row], lambda rid, text: failures.append(text))
    assert failures and "no moved_out" in failures[0]


def test_kept_blocks_free_their_bytes_when_dropped(tmp_path: pathlib.Path, sessions: list[PromptSpec]) -> None:
    engine = _engine(tmp_path, True)
    run_sessions(engine, [s for s in sessions if s.turn == 0][:1])
    pool = engine.kv_store.device_pool
    kept = engine.prefix.summary()["num_kept_layer_blocks_on_device"]
    assert kept > 0 and pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] == kept * engine.kv_store.bytes_per_block
    stats = engine.prefix.stats
    assert stats.num_kept_blocks > 1 and stats.num_reused_blocks == 0  # one turn: nothing adopted yet
    prefix_ids = [r for r in engine.kv_store.tables if r.startswith(PREFIX_ID)]
    info = engine.prefix.entry_info(prefix_ids[0])
    assert info.reuse_share == 1 / (1 + stats.num_kept_blocks) and prefix_spill_mode(info) is SpillMode.DROP
    for rid in prefix_ids:
        engine.executor.spill_kv((rid, 0, 0), SpillMode.DROP)
    engine.prefix._prune()
    assert engine.prefix.summary()["num_kept_now"] == 0
    assert pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] == 0
    engine.close()


def test_a_sessions_kept_blocks_keep_a_copy_however_seldom_the_run_adopts(
    tmp_path: pathlib.Path, sessions: list[PromptSpec]
) -> None:
    engine = _engine(tmp_path, True)
    first = next(s for s in sessions if s.turn == 0)
    prompt = engine.tokenizer.encode(first.prompt)
    engine.add_request(prompt, SamplingParams(max_new_tokens=4), first.request_id, session_id=first.session)
    while engine.has_unfinished():
        engine.step()
    infos = [engine.prefix.entry_info(rid) for rid in engine.kv_store.tables if rid.startswith(PREFIX_ID)]
    assert len(infos) == (len(prompt) + 4 - 1) // engine.kv_store.block_size  # every full block kept
    assert all(i is not None and i.is_session and i.num_hits == 0 and i.reuse_share < 0.5 for i in infos)
    assert {prefix_spill_mode(i) for i in infos} == {SpillMode.HOST_FULL}  # its next turn is declared
    assert prefix_spill_mode(dataclasses.replace(infos[0], is_session=False)) is SpillMode.DROP
    engine.close()


@pytest.mark.slow
def test_run_on_a_multi_turn_workload_reuses_prefixes_and_passes_the_audit(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts, ledger, trace_dir = tmp_path / "mt.jsonl", tmp_path / "l.db", tmp_path / "trace"
    assert main(["workload", "multi-turn", "--out", str(prompts), "--seed", "1", "--num-requests", "6"]) == 0
    status = main(["run", "--prompts", str(prompts), "--ledger", f"sqlite:///{ledger}", "--trace", str(trace_dir),
                   "--device-budget-mb", "64", "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "PASS" in out, out
    line = next(x for x in out.splitlines() if x.startswith("prefix reuse:"))
    assert int(line.split()[2]) > 0, line  # "prefix reuse: N blocks reused by ..."
    with sqlite3.connect(ledger) as db:
        reused = db.execute("select sum(num_reused_tokens) from requests").fetchone()[0]
    assert reused > 0
    kv = read_trace(trace_dir).frame("kv_access")
    hashed = kv.dropna(subset=["content_hash"])
    assert len(hashed) and hashed["content_hash"].astype("uint64").ne(0).all()
    per_hash = hashed.groupby("content_hash")["request"].nunique()
    assert (per_hash > 1).any()  # a turn read blocks with the hash an earlier turn's blocks had

    status = main(["run", "--prompts", str(prompts), "--no-ledger", "--no-prefix-reuse", "--device-budget-mb", "64",
                   "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "prefix reuse: off" in out


def test_the_joint_controller_weighs_kept_prefixes_against_experts() -> None:
    hot, cold = PrefixEntryInfo("aa", 5, 0, 1), PrefixEntryInfo("bb", 0, 200, 1)
    view = StaticView(
        CPU_BOX, device_budget_bytes=1 << 20, bytes_per_expert=1 << 16, bytes_per_kv_block=1 << 10,
        on_device_experts=((0, 1),), is_ram_tiered=True,
        kv_blocks=(KVBlockInfo(("prefix:aa", 0, 0), 16, Tier.DEVICE, None),
                   KVBlockInfo(("prefix:bb", 0, 0), 16, Tier.DEVICE, None)),
        prefix_entries={"prefix:aa": hot, "prefix:bb": cold},
        quantized_copy_bytes={(ObjectKind.KV_BLOCK, 8): 300},
    )  # fmt: skip
    joint = JointController(POLICY)
    joint.values.set_frequencies({(0, 1): 0.5})
    values = joint.values
    assert values.prefix_value(hot, view) > values.expert_value((0, 1), view) > values.prefix_value(cold, view)
    order = [v.kv_block_key[0] if v.kv_block_key else "expert" for v in joint.choose_victims(1, view, set(), set())]
    assert order == ["prefix:bb", "expert", "prefix:aa"]  # the cold prefix leaves RAM first, the hot one last
    assert list(joint.choose_victims(1, view, set(), set())) == ref.joint_victims(joint, view, set(), set())
    modes = {v.spill_mode for v in joint.choose_victims(1, view, set(), set()) if v.kv_block_key}
    assert modes == {SpillMode.HOST_FULL}  # no share given: as if every kept block were adopted


def test_where_kept_prefixes_are_seldom_adopted_an_unadopted_one_leaves_sooner_and_without_a_copy() -> None:
    view = StaticView(CPU_BOX, bytes_per_kv_block=1 << 10, is_ram_tiered=True)
    values = JointController(POLICY).values
    fresh, seldom = PrefixEntryInfo("aa", 0, 0, 1), PrefixEntryInfo("aa", 0, 0, 1, reuse_share=0.2)
    assert values.prefix_value(seldom, view) == pytest.approx(0.2 * values.prefix_value(fresh, view))
    adopted = PrefixEntryInfo("aa", 1, 3, 1, reuse_share=0.2)  # (0.2 + 1) / (1 + 3)
    assert values.prefix_value(adopted, view) == pytest.approx(0.3 * values.prefix_value(fresh, view))
    often = PrefixEntryInfo("aa", 0, 0, 1, reuse_share=3.0)  # a share above 1 is a certain reuse, no more
    assert values.prefix_value(often, view) == values.prefix_value(fresh, view)
    assert prefix_spill_mode(seldom) is SpillMode.DROP  # most kept blocks are never adopted: no write
    assert prefix_spill_mode(adopted) is SpillMode.HOST_FULL  # adopted once: kept on disk
    assert prefix_spill_mode(PrefixEntryInfo("aa", 0, 0, 1, reuse_share=0.5)) is SpillMode.HOST_FULL
