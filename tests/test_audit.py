"""Diff statistics against hand-computed numbers (llama.cpp --kl-divergence / vLLM definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from fallbackgate.audit.stats import (
    PositionDiff,
    audit,
    percentile,
    position_diffs,
    request_stats,
)


def _log(p: list[float]) -> list[float]:
    return [math.log(x) for x in p]


def test_identical_logits_give_exactly_zero() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    diffs, stats = audit(logits, logits.clone(), [1, 2, 3, 4, 5, 6])
    assert all(d.kl == 0.0 and d.delta_p == 0.0 and d.max_abs_dlogit == 0.0 for d in diffs)
    assert all(d.top1_agree and d.vllm_top5_ok for d in diffs)
    assert stats.max_kl == 0.0 and stats.mean_kl == 0.0 and stats.sem_kl == 0.0
    assert stats.top1_agreement == 1.0 and stats.ppl_ratio == 1.0 and stats.rms_delta_p == 0.0
    assert stats.first_divergence is None


def test_three_token_vocabulary_by_hand() -> None:
    # exact p = (0.5, 0.3, 0.2), engine q = (0.2, 0.3, 0.5)
    exact = torch.tensor([_log([0.5, 0.3, 0.2])] * 2)
    engine = torch.tensor([_log([0.2, 0.3, 0.5])] * 2)
    d0, d1 = position_diffs(exact, engine, [0, 1])
    # KL = 0.5 ln(0.5/0.2) + 0.3 ln(1) + 0.2 ln(0.2/0.5) = 0.3 ln 2.5
    assert d0.kl == pytest.approx(0.3 * math.log(2.5), abs=1e-7)
    assert d0.top1_agree is False  # argmax 0 vs 2
    assert d0.vllm_top5_ok is True  # V=3: every token is in both top-5s
    assert d0.delta_p == pytest.approx(0.2 - 0.5, abs=1e-7)
    assert d1.delta_p == pytest.approx(0.0, abs=1e-7)
    assert d0.max_abs_dlogit == pytest.approx(math.log(2.5), abs=1e-6)
    assert d0.logp_exact == pytest.approx(math.log(0.5), abs=1e-7)
    assert d0.logp_engine == pytest.approx(math.log(0.2), abs=1e-7)
    stats = request_stats([d0, d1])
    assert stats.first_divergence == 0 and stats.top1_agreement == 0.0
    assert stats.rms_delta_p == pytest.approx(math.sqrt(0.09 / 2), abs=1e-7)
    # PPL ratio = exp(mean NLL_engine - mean NLL_exact) = exp(((-ln .2) - (-ln .5) + 0) / 2)
    assert stats.ppl_ratio == pytest.approx(math.sqrt(2.5), abs=1e-6)


def test_kl_is_shift_invariant_and_logits_diff_is_not() -> None:
    exact = torch.randn(3, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    diffs = position_diffs(exact, exact + 3.0, [0, 1, 2])
    assert max(d.kl for d in diffs) < 1e-12
    assert all(d.max_abs_dlogit == pytest.approx(3.0) for d in diffs)


def test_vllm_check_fails_when_argmax_outside_other_top5() -> None:
    exact = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.0]])
    engine = torch.tensor([[0.0, 8.0, 7.0, 6.0, 5.0, 4.0, 9.0]])  # engine's top-5 lacks token 0
    (d,) = position_diffs(exact, engine, [1])
    assert d.top1_agree is False and d.vllm_top5_ok is False
    exact = torch.tensor([[9.0, 8.0, 7.0, 6.0, 0.0, 0.0, 5.0]])  # 6 in exact's top-5
    near = torch.tensor([[8.5, 8.0, 7.0, 6.0, 5.0, 4.0, 9.0]])  # 0 in engine's top-5
    (d,) = position_diffs(exact, near, [1])
    assert d.top1_agree is False and d.vllm_top5_ok is True


def _pd(
    pos: int,
    kl: float,
    agree: bool = True,
    dp: float = 0.0,
    lpe: float = -1.0,
    lpq: float = -1.0,
) -> PositionDiff:
    return PositionDiff(pos, 0, kl, agree, dp, 0.0, True, lpe, lpq)


def test_request_summary_numbers() -> None:
    diffs = [
        _pd(0, 0.0),
        _pd(1, 1.0),
        _pd(2, 2.0, agree=False, dp=0.3),
        _pd(3, 3.0, agree=False, dp=-0.4),
    ]
    s = request_stats(diffs)
    assert s.mean_kl == 1.5 and s.median_kl == 1.5 and s.max_kl == 3.0
    assert s.p99_kl == pytest.approx(2.97)  # 0.99 * 3 = 2.97 -> between order stats 2 and 3
    assert s.sem_kl == pytest.approx(math.sqrt((3.5 - 2.25) / 3))  # llama.cpp's mean ± uncertainty
    assert s.top1_agreement == 0.5 and s.first_divergence == 2
    assert s.rms_delta_p == pytest.approx(math.sqrt((0.09 + 0.16) / 4))
    assert s.num_positions == 4


def test_ppl_ratio_from_nll_gap() -> None:
    diffs = [_pd(0, 0.1, lpe=-1.0, lpq=-2.0), _pd(1, 0.1, lpe=-3.0, lpq=-3.5)]
    assert request_stats(diffs).ppl_ratio == pytest.approx(math.exp(0.75))


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([0.0, 10.0], 0.5) == 5.0
    assert percentile([0.0, 1.0, 2.0], 0.0) == 0.0 and percentile([0.0, 1.0, 2.0], 1.0) == 2.0


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        position_diffs(torch.zeros(2, 3), torch.zeros(2, 4), [0, 0])
    with pytest.raises(ValueError, match="token ids"):
        position_diffs(torch.zeros(2, 3), torch.zeros(2, 3), [0])
    with pytest.raises(ValueError):
        request_stats([])
