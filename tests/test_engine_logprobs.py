"""Prompt log-probabilities computed at prefill (what ``echo`` with ``logprobs`` serves), equal to the engine's
own teacher-forced scoring, across prefill chunks and without keeping rows; and ``abort_request``: the
request leaves the scheduler, its KV blocks are freed, the others are served as if it never ran."""

from __future__ import annotations

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv.prefix_cache import PREFIX_ID
from fallbackgate.engine.model.scoring import score
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind

PROMPT = [5, 17, 33, 9, 101, 250, 7, 64, 12, 300, 41, 8, 77, 19]


@pytest.fixture(scope="module")
def engine(checkpoint_factory) -> Engine:
    config = EngineConfig(model_dir=str(checkpoint_factory("qwen3_moe")), block_size=4, max_num_batched_tokens=8)
    built = Engine(config, ExactLRUController())
    yield built
    built.close()


def _finish(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_prompt_logprobs_equal_teacher_forced_scoring_across_prefill_chunks(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=2, num_prompt_logprobs=3, num_top_logprobs=3)
    rid = engine.add_request(PROMPT, params, request_id="echo", is_logits_kept=False)
    _finish(engine)  # 14 prompt tokens in chunks of at most 8
    output = engine.finished.pop(rid)
    assert output.prompt_logits is None and output.output_logits is None  # no rows kept
    assert [e.token_id for e in output.prompt_logprobs] == PROMPT[1:]
    (scored,) = score(engine, [(PROMPT[:1], PROMPT[1:])], id_prefix="tf")
    got = [e.logprob for e in output.prompt_logprobs]
    assert got == pytest.approx(scored.token_logprobs, abs=1e-5)
    for entry in output.prompt_logprobs:
        assert len(entry.top_ids) == 3 and list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
        assert entry.logprob <= entry.top_logprobs[0] + 1e-6
    assert len(output.output_logprobs) == 2 and output.output_logprobs[0].token_id == output.output_token_ids[0]


def test_prompt_logprobs_top_k_are_those_of_the_logits(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=1, num_prompt_logprobs=2)
    rid = engine.add_request(PROMPT[:6], params, request_id="topk")
    scored = engine.add_request(PROMPT[:6], SamplingParams(max_new_tokens=1), "rows", num_scored_tokens=6)
    _finish(engine)
    entries, rows = engine.finished.pop(rid).prompt_logprobs, engine.finished.pop(scored).prompt_logits
    for entry, row in zip(entries, rows[:-1], strict=True):
        values, ids = torch.topk(torch.log_softmax(row, dim=-1), 2)
        assert list(entry.top_ids) == ids.tolist() and list(entry.top_logprobs) == pytest.approx(values.tolist())


def test_abort_request_frees_its_kv_and_leaves_the_others_alone(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=6)
    alone = engine.add_request(PROMPT, params, request_id="alone")
    _finish(engine)
    expected = engine.finished.pop(alone).output_token_ids
    kept = engine.add_request(PROMPT, params, request_id="kept")
    engine.add_request(PROMPT[:5], SamplingParams(max_new_tokens=50), request_id="gone")
    while not engine.sequences["gone"].output_token_ids:
        engine.step()
    partial = engine.abort_request("gone")
    assert 0 < len(partial.output_token_ids) < 50 and partial.prompt_token_ids == PROMPT[:5]
    assert "gone" not in engine.sequences and "gone" not in engine.kv_store.tables
    assert all(s.request_id != "gone" for q in (engine.scheduler.waiting, engine.scheduler.running) for s in q)
    engine.add_request(PROMPT[:3], params, request_id="never-ran")
    assert engine.abort_request("never-ran").output_token_ids == []  # still waiting: it just leaves
    _finish(engine)
    assert engine.finished.pop(kept).output_token_ids == expected
    assert engine.sequences == {} and engine.finished == {}
    assert all(rid.startswith(PREFIX_ID) for rid in engine.kv_store.tables)  # only kept prefix blocks stay
    kept = engine.prefix.summary()["num_kept_layer_blocks_on_device"] * engine.kv_store.bytes_per_block
    assert engine.kv_store.device_pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] == kept  # every other block freed
