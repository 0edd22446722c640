"""A finished request leaves the engine: its sequence is gone, its full logits were kept only when it was chosen
for audit, ids and seeds count on from a monotonic counter exactly as before, and top-k log-probabilities are
computed when the token is sampled."""

from __future__ import annotations

import pytest
import torch

from fallbackgate.audit.auditor import audited_ids, choose_audited
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings, run_prompts
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import PromptError
from fallbackgate.engine.sequence import SamplingParams

PROMPT = [5, 17, 33, 9, 101, 250, 7]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def engine(checkpoint_factory) -> Engine:
    built = Engine(EngineConfig(model_dir=str(checkpoint_factory("qwen3_moe")), block_size=4), ExactLRUController())
    yield built
    built.close()


def _finish(engine: Engine) -> list:
    results = []
    while engine.has_unfinished():
        results.append(engine.step())
    return results


def test_a_finished_request_leaves_the_engine_and_keeps_logits_only_when_audited(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    audited = engine.add_request(PROMPT, params, request_id="audited", is_logits_kept=True)
    plain = engine.add_request(PROMPT, params, request_id="plain", is_logits_kept=False)
    results = _finish(engine)
    assert engine.sequences == {}  # both finished: nothing of them stays in the engine
    assert all("plain" not in r.logits for r in results)  # no step result carries the unaudited row either
    assert sum("audited" in r.logits for r in results) == NEW_TOKENS
    kept, dropped = engine.finished.pop(audited), engine.finished.pop(plain)
    assert engine.finished == {}
    assert dropped.output_logits is None
    assert kept.output_logits.shape == (NEW_TOKENS, int(engine.model_config.vocab_size))
    assert dropped.output_token_ids == kept.output_token_ids  # greedy: the same tokens either way
    assert kept.output_token_ids == [int(row.argmax()) for row in kept.output_logits]
    row = results[-1].logits["audited"]
    assert row.untyped_storage().nbytes() == row.numel() * 4  # its own row, not a view of the step's logits


def test_ids_and_seeds_count_on_after_requests_leave(engine: Engine) -> None:
    first = engine.num_added
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.5)
    rid = engine.add_request(PROMPT, sampled)
    assert rid == f"req-{first}"
    _finish(engine)
    drawn = engine.finished.pop(rid).output_token_ids
    later = engine.add_request(PROMPT, sampled)  # len(sequences) is 0 again: the counter is not
    assert later == f"req-{first + 1}"
    _finish(engine)
    engine.finished.pop(later)
    with pytest.raises(PromptError, match="already in use"):
        engine.add_request(PROMPT, sampled, request_id=rid)  # finished, yet its id stays taken
    explicit = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.5, seed=engine.config.seed + first)
    again = engine.add_request(PROMPT, explicit, request_id="explicit-seed")
    _finish(engine)
    assert engine.finished.pop(again).output_token_ids == drawn  # the default seed was config.seed + counter


def test_top_logprobs_are_computed_at_sampling(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, num_top_logprobs=3)
    rid = engine.add_request(PROMPT, params, request_id="logprobs", is_logits_kept=True)
    _finish(engine)
    output = engine.finished.pop(rid)
    assert len(output.output_logprobs) == NEW_TOKENS
    for token, logits, got in zip(output.output_token_ids, output.output_logits, output.output_logprobs, strict=True):
        logp = torch.log_softmax(logits, dim=-1)
        values, ids = torch.topk(logp, 3)
        assert got.token_id == token and got.logprob == pytest.approx(float(logp[token]), abs=1e-6)
        assert list(got.top_ids) == ids.tolist()
        assert list(got.top_logprobs) == pytest.approx(values.tolist(), abs=1e-6)


def test_a_batch_run_keeps_logits_of_its_audit_sample_only(engine: Engine) -> None:
    specs = [PromptSpec(f"Once upon a time {i}", f"p{i}") for i in range(8)]
    chosen = audited_ids([s.request_id for s in specs], 0.4, seed=3)
    assert 0 < len(chosen) < len(specs)
    settings = RunSettings(model_dir=engine.config.model_dir, max_new_tokens=3)
    outcome = run_prompts(engine, specs, settings, None, False, logits_kept_ids=chosen)
    assert {o.request_id for o in outcome.outputs if o.output_logits is not None} == chosen
    assert [o.request_id for o in choose_audited(outcome.outputs, 0.4, seed=3)] == sorted(chosen)
    assert engine.sequences == {} and engine.finished == {}
