"""Routing digests and the replay's near-tie search (``audit/routing_ties.py``).

A long-retrieval request once failed its replay with "the served int8 codes are not a re-quantization of
the replay's K/V": at layer 3 one prompt token's 2nd and 3rd router logits were 1.5e-7 apart, the served
prefill (another chunking) routed it to the other expert, and its K/V at layer 4 differed by 0.13. The engine
now records a digest of each step's routing per request and layer; the replay routes as served."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fallbackgate.audit import routing_ties
from fallbackgate.audit.replay import Replayer
from fallbackgate.audit.replay_trace import load_trace
from fallbackgate.audit.routing_ties import RoutingError, served_routing
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.routing import digest_sum, digest_terms, request_digests
from fallbackgate.ledger.db import open_ledger
from fallbackgate.recording import record_and_judge
from fallbackgate.tinymoe import CHECKPOINT_DIR


def _digest(positions: np.ndarray, ids: np.ndarray) -> int:
    return digest_sum(digest_terms(positions, ids))


def test_a_digest_ignores_top_k_order_and_sees_one_swapped_expert() -> None:
    positions = np.arange(10, 14)
    ids = np.array([[1, 5], [2, 3], [7, 0], [4, 6]])
    assert _digest(positions, ids) == _digest(positions, ids[:, ::-1])
    swapped = ids.copy()
    swapped[2, 1] = 9
    assert _digest(positions, swapped) != _digest(positions, ids)
    assert _digest(positions + 1, ids) != _digest(positions, ids)  # the same experts at other positions


def test_request_digests_split_a_packed_forward_by_request() -> None:
    ids = np.array([[1, 5], [2, 3], [7, 0], [4, 6], [3, 3]])
    got = request_digests(ids.reshape(-1), 2, starts=[40, 0], lengths=[3, 2])
    assert got == [_digest(np.arange(40, 43), ids[:3]), _digest(np.arange(0, 2), ids[3:])]


def test_a_decodes_digests_are_the_same_with_python_ints_and_with_numpy() -> None:
    """Small decode forwards digest with Python ints, large ones with numpy: each request's digest is its
    (position, expert) terms summed either way."""
    gen = np.random.default_rng(0)
    for num_requests, top_k in ((1, 2), (3, 8), (40, 2)):  # 2, 24 and 80 rows (the last one through numpy)
        ids = gen.integers(0, 1 << 20, size=(num_requests, top_k))
        starts = gen.integers(0, 1 << 30, size=num_requests).tolist()
        got = request_digests(ids.reshape(-1), top_k, starts=starts, lengths=[1] * num_requests)
        assert got == [_digest(np.array([start]), ids[i : i + 1]) for i, start in enumerate(starts)]


def _tied(num_tokens: int = 12, num_experts: int = 8, ties: dict[int, float] | None = None) -> torch.Tensor:
    """Router scores where each token's top-2 are clear winners except at `ties` (token -> gap between its
    2nd and 3rd expert)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    for token, gap in (ties or {}).items():
        second = scores[token].topk(2).values[-1]
        third = int(scores[token].topk(3).indices[-1])
        scores[token, third] = second - gap
    return scores


def _swap_third(scores: torch.Tensor, token: int, ids: torch.Tensor) -> torch.Tensor:
    out = ids.clone()
    out[token, 1] = int(scores[token].topk(3).indices[-1])
    return out


def test_the_replay_follows_a_served_swap_at_a_near_tie_and_only_there() -> None:
    scores = _tied(ties={3: 2e-7, 8: 5e-7})
    ids = scores.topk(2).indices  # the replay's own routing (2nd expert at slot 1)
    positions = np.arange(100, 112)
    asked = []

    def ask() -> torch.Tensor:
        asked.append(1)
        return scores

    same, n = served_routing(ids, positions, _digest(positions, ids.numpy()), ask, "here")
    assert n == 0 and torch.equal(same, ids) and not asked  # scores only on a mismatch
    for tokens in ([3], [3, 8]):
        served = ids
        for token in tokens:
            served = _swap_third(scores, token, served)
        got, n = served_routing(ids, positions, _digest(positions, served.numpy()), ask, "here")
        assert n == len(tokens) and torch.equal(got, served)
    far = _swap_third(scores, 5, ids)  # token 5's 3rd expert is not near a tie: no rounding explains it
    with pytest.raises(RoutingError, match="here: the replay's routing differs from the served one"):
        served_routing(ids, positions, _digest(positions, far.numpy()), ask, "here")


def test_in_16_bit_dtypes_the_window_is_rounding_steps_of_the_tokens_scores() -> None:
    """bf16 keeps 8 bits: a gap of 0.02 between router scores near 4 is a rounding step or two, not a routing
    the inputs do not give; float32 keeps its 1e-5 window. A swap must still reproduce the digest, and a swap
    farther than the window still fails."""
    scores = _tied(ties={3: 0.02, 5: 1.0}) + 4.0  # every token's largest score is above 4
    for dtype in (torch.bfloat16, torch.float16):
        low = scores.to(dtype)
        expected = routing_ties.TIE_STEPS_16BIT * torch.finfo(dtype).eps * low.float().abs().amax(1).numpy()
        assert np.allclose(routing_ties.tie_window(low), np.maximum(expected, routing_ties.ROUTING_TIE))
    assert np.all(routing_ties.tie_window(scores) == routing_ties.ROUTING_TIE)
    bf16 = scores.to(torch.bfloat16)
    ids = scores.topk(2).indices
    positions = np.arange(100, 112)
    served = _swap_third(scores, 3, ids)
    recorded = _digest(positions, served.numpy())
    with pytest.raises(RoutingError, match="within 1e-05 of a"):
        served_routing(ids, positions, recorded, lambda: scores, "fp32")
    got, n = served_routing(ids, positions, recorded, lambda: bf16, "bf16")
    assert n == 1 and torch.equal(got, served)
    far = _swap_third(scores, 5, ids)  # a gap of 1.0: beyond 8 bf16 steps at 4-8 (0.25-0.5)
    assert float(routing_ties.tie_window(bf16)[5]) < 1.0
    with pytest.raises(RoutingError, match="bf16: the replay's routing differs"):
        served_routing(ids, positions, _digest(positions, far.numpy()), lambda: bf16, "bf16")
    with pytest.raises(RoutingError, match="bf16: the replay's routing differs"):
        served_routing(ids, positions, recorded ^ (1 << 40), lambda: bf16, "bf16")  # no swap gives this digest


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, str, int]:
    """A short exact run of the bundled model, recorded to a ledger (prefill chunks of 16 tokens)."""
    path = tmp_path_factory.mktemp("routing") / "ledger.sqlite"
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), seed=0, max_num_batched_tokens=16)
    engine = Engine(config, ExactLRUController(()))
    settings = RunSettings(model_dir=str(CHECKPOINT_DIR), max_new_tokens=6, seed=0)
    prompts = ["Once upon a time there was a little girl who lived in a village near the forest.", "Hello"]
    recorded = record_and_judge(engine, prompts, str(path), settings=settings)
    assert all(v.correctness_passed for v in recorded.verdict.requests)
    return engine, str(path), recorded.run_id


def test_every_step_records_the_routing_the_replay_computes(exact_run: tuple[Engine, str, int]) -> None:
    engine, path, run_id = exact_run
    with open_ledger(path, read_only=True) as ledger:
        trace = load_trace(ledger, run_id, "prompt-0")
    moe_layers = sorted(engine.executor.routers)
    assert len(trace.segments) >= 7  # prefill chunks, then decode steps
    assert all(sorted(trace.routing[s.step_id]) == moe_layers for s in trace.segments)
    replayer = Replayer(engine, trace)
    list(replayer.run())
    assert replayer.num_routing_swaps == 0


def test_a_recorded_swap_is_followed_and_an_unexplained_one_fails(
    exact_run: tuple[Engine, str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plant, in the ledger's trace, the digest of the served forward having routed the last prompt token to
    its 3rd expert at the last MoE layer (nothing downstream in that forward routes again; the tie is made wide
    enough to be searched): the replay follows it and the first output's logits change; a digest no swap
    explains fails the replay."""
    engine, path, run_id = exact_run
    with open_ledger(path, read_only=True) as ledger:
        trace = load_trace(ledger, run_id, "prompt-0")
    plain = torch.cat(list(Replayer(engine, trace).run()))
    seg, layer = next(s for s in trace.segments if s.is_sampled), max(engine.executor.routers)
    captured = {}

    def capture(self: Replayer, layer_: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        if layer_ == layer and seg in self.segments and "scores" not in captured:
            rows = slice(seg.start - self.start, seg.start - self.start + seg.num_tokens)
            captured["scores"] = engine.router_scores(layer, hidden[rows])
            captured["ids"] = top_k_index[rows].clone()
        return original(self, layer_, hidden, top_k_index)

    original = Replayer._served_routing
    monkeypatch.setattr(Replayer, "_served_routing", capture)
    list(Replayer(engine, trace).run())
    monkeypatch.setattr(Replayer, "_served_routing", original)
    scores, ids = captured["scores"], captured["ids"]
    chosen = scores.gather(1, ids)
    others = scores.scatter(1, ids, float("-inf"))
    gap = chosen.min(1).values - others.max(1).values
    token = seg.num_tokens - 1
    served = ids.clone()
    served[token, int(chosen[token].argmin())] = int(others[token].argmax())
    positions = np.arange(seg.start, seg.start + seg.num_tokens)
    monkeypatch.setattr(routing_ties, "ROUTING_TIE", float(gap[token]) * 1.01)  # other tokens may be nearer
    trace.routing[seg.step_id][layer] = _digest(positions, served.numpy())
    replayer = Replayer(engine, trace)
    swapped = torch.cat(list(replayer.run()))
    assert replayer.num_routing_swaps == 1
    assert float((swapped[0] - plain[0]).abs().max()) > 1e-4  # the swapped expert changed the first output
    trace.routing[seg.step_id][layer] ^= 1 << 40
    with pytest.raises(RoutingError, match=f"step {seg.step_id}, layer {layer}"):
        list(Replayer(engine, trace).run())
