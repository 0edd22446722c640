"""The analyses recover what the planted synthetic trace was generated with; the cache simulator agrees with a
plain LRU; the report answers the six questions; the ledger holds the numbers; the step adapter's rows."""

from __future__ import annotations

import collections
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fallbackgate.cli import main
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.trace_queries import analysed_traces, trace_analyses
from fallbackgate.tracing import TraceTable, TraceWriter, read_trace
from fallbackgate.tracing.analyze import trace_labels
from fallbackgate.tracing.cachesim import stack_distances
from fallbackgate.tracing.coburst import co_burst
from fallbackgate.tracing.contention import overlap, union
from fallbackgate.tracing.devices import DeviceModel, fit_measured
from fallbackgate.tracing.recorder import ExpertStep, KVReads, KVStep, StepTracer
from fallbackgate.tracing.report import _q2
from fallbackgate.tracing.results import Analysis, AnalysisResult, AnalysisRow
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.timeline import build_timeline


def lru_misses(keys: list[int], capacity: int) -> list[bool]:
    """A plain LRU of ``capacity`` objects (first accesses miss)."""
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    misses = []
    for key in keys:
        misses.append(key not in cache)
        cache[key] = None
        cache.move_to_end(key)
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stack_distances_price_like_a_plain_lru(seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys = (rng.zipf(1.3, 4000) % 200).astype(np.int64)
    distances = stack_distances(keys)
    for capacity in (1, 5, 17, 64, 199):
        simulated = (distances < 0) | (distances >= capacity)
        assert simulated.tolist() == lru_misses(keys.tolist(), capacity)


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Planted, Path, Path, str]:
    base = tmp_path_factory.mktemp("planted")
    planted = write_planted_trace(base / "trace", Planted(seed=0))
    ledger = base / "ledger.sqlite"
    out = base / "report.md"
    assert main(["report", "--trace", str(base / "trace"), "--out", str(out), "--ledger", str(ledger)]) == 0
    return planted, base / "trace", ledger, out.read_text()


def _rows(ledger: Path, analysis: str, metric: str, device: str | None = None) -> list[dict]:
    with open_ledger(str(ledger), read_only=True) as opened:
        rows = trace_analyses(opened)
    return [r for r in rows if r["analysis"] == analysis and r["metric"] == metric and device in (None, r["device"])]


def test_co_burst_recovers_planted_lift_and_lag(planted_report: tuple) -> None:
    planted, _, ledger, _ = planted_report
    (lift,) = _rows(ledger, "co_burst", "lift")
    assert lift["value"] == pytest.approx(planted.expected_lift, rel=0.08)  # tolerance: ~2 bootstrap SEs
    assert lift["ci_low"] < planted.expected_lift < lift["ci_high"] and lift["ci_low"] > 1
    (peak,) = _rows(ledger, "co_burst", "peak_lag")
    assert peak["value"] == planted.kv_lag_steps
    lag0 = next(r for r in _rows(ledger, "co_burst", "cross_correlation") if r["params"]["lag"] == 0)
    assert peak["params"]["ci_low"] > lag0["ci_high"]  # the lagged peak is clear of the same-step correlation


def test_io_overlap_is_the_shared_busy_time() -> None:
    expert = union(np.array([0, 5, 30]), np.array([10, 12, 40]))  # busy [0, 12) and [30, 40): 22 ns
    kv = union(np.array([8, 35]), np.array([20, 50]))  # busy [8, 20) and [35, 50): 27 ns
    assert expert == [(0, 12), (30, 40)] and overlap(expert, kv) == 4 + 5


def test_planted_reads_are_serial(planted_report: tuple) -> None:
    _, _, ledger, text = planted_report
    assert _rows(ledger, "co_burst", "io_overlap_share_expert")[0]["value"] == 0.0
    assert _rows(ledger, "co_burst", "mean_queue_depth_at_submit")[0]["value"] == 1.0
    assert "in flight with a KV read 0.0 %" in text


def test_independent_misses_give_lift_one(tmp_path: Path) -> None:
    lifts = []
    for seed in range(8):
        planted = Planted(seed=seed, lift_in_cell=1.0, burst_amplitude=0.0, num_steps_per_phase=300)
        write_planted_trace(tmp_path / str(seed), planted)
        lifts.append(next(r for r in co_burst(read_trace(tmp_path / str(seed))).rows if r.metric == "lift"))
    assert np.mean([r.value for r in lifts]) == pytest.approx(1.0, abs=0.08)  # ~3 SEs of the mean of 8
    assert sum(r.ci_low < 1.0 < r.ci_high for r in lifts) >= 6  # 95 % intervals: P(3+ misses of 8) < 1 %


def test_flips_recover_the_planted_split(planted_report: tuple) -> None:
    planted, _, ledger, _ = planted_report
    shares = [r["value"] for r in _rows(ledger, "flips", "best_expert_share", "measured")]
    assert shares == [planted.expert_share_a] * 5 + [planted.expert_share_b] * 5
    assert [r["value"] for r in _rows(ledger, "flips", "num_flips")] == [1.0, 1.0, 1.0]


def test_measured_device_is_fitted_from_the_io_rows(planted_report: tuple) -> None:
    planted, trace_dir, _, _ = planted_report
    device = fit_measured(read_trace(trace_dir))
    assert device.latency_ns == pytest.approx(planted.latency_ns, rel=0.05)
    assert device.bandwidth_bytes_per_s == pytest.approx(planted.bandwidth_bytes_per_s, rel=0.02)


def test_marginal_value_is_the_lru_stall_difference(planted_report: tuple) -> None:
    planted, trace_dir, ledger, _ = planted_report
    trace = read_trace(trace_dir)
    timeline = build_timeline(trace)
    device = DeviceModel("flat", 1e5, 2e9)
    experts = trace.frame(TraceTable.EXPERT_ACCESS)
    keys = (experts["layer"] * planted.num_experts + experts["expert"]).tolist()
    base, more = (planted.total_budget_bytes // 2) // planted.bytes_per_expert, None
    more = base + (planted.total_budget_bytes // 4) // planted.bytes_per_expert
    removed = sum(lru_misses(keys, base)) - sum(lru_misses(keys, more))
    stall = timeline.step_ns(512 << 20, 512 << 20, device).sum() - timeline.step_ns(768 << 20, 512 << 20, device).sum()
    assert stall == pytest.approx(removed * device.read_ns(planted.bytes_per_expert))
    per_gib = _rows(ledger, "marginal_value", "stall_s_reduced_per_gib_experts", "measured")[0]["value"]
    measured = fit_measured(trace)
    assert per_gib == pytest.approx(removed * measured.read_ns(planted.bytes_per_expert) / 1e9 / 0.25)


def test_dual_miss_and_prediction_recover_planted_numbers(planted_report: tuple) -> None:
    planted, _, ledger, _ = planted_report
    crossings = {r["params"]["phase"]: r["value"] for r in _rows(ledger, "dual_miss", "recompute_crossover_tokens",
                                                                   "measured")}  # fmt: skip
    assert crossings["prefill"] == pytest.approx(planted.crossover_tokens(0), rel=0.01)
    assert crossings["decode"] == pytest.approx(planted.crossover_tokens(1), rel=0.01)
    precision = {r["params"]["predictor"]: r["value"] for r in _rows(ledger, "prediction", "precision")}
    assert precision["router"] == pytest.approx(planted.expected_router_precision(), abs=0.03)
    wrong_kv = next(r for r in _rows(ledger, "prediction", "wrongly_predicted_bytes")
                    if r["params"]["predictor"] == "kv_recency")  # fmt: skip
    # phase A's requests end: their last reads (requests × layers × blocks) are predicted and never come
    _, blocks_a = planted.working_sets(0)
    expected = planted.num_requests_per_phase * planted.num_layers * blocks_a * planted.bytes_per_kv_block
    assert wrong_kv["value"] == expected


def test_report_answers_the_six_questions(planted_report: tuple) -> None:
    _, trace_dir, ledger, text = planted_report
    for number in range(1, 7):
        assert f"## {number}. " in text
    assert "lift **1.7" in text and "lag **3** steps" in text
    assert "| best-split flips | 1 | 1 |" in text
    served = [line for line in text.splitlines() if line.startswith("| prefill | ") or line.startswith("| decode | ")]
    shares = {}
    for line in served:
        phase, context, option, share = (cell.strip() for cell in line.strip("|").split("|"))
        shares[(phase, context, option)] = float(share)
    # planted: recompute below 1,149 context tokens in prefill and 287 in decode, expert-first above
    assert shares[("prefill", "<256", "recompute")] == shares[("prefill", "<1k", "recompute")] == 1.0
    assert shares[("decode", "<256", "recompute")] == shares[("decode", "<4k", "expert_first")] == 1.0
    assert 0.0 < shares[("prefill", "<4k", "recompute")] < 0.1  # 1,025-1,149 of 1,025-4,095
    figures = [line.split("(")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(figures) == 5
    with open_ledger(str(ledger), read_only=True) as opened:
        (listed,) = analysed_traces(opened)
    assert listed["trace_path"] == str(trace_dir.resolve()) and listed["num_rows"] > 50


def test_two_traces_of_one_workload_keep_their_own_sections_and_figures(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_planted_trace(tmp_path / name, Planted(seed=0, num_steps_per_phase=20))
    out = tmp_path / "report.md"
    assert main(["report", "--trace", str(tmp_path / "a"), "--trace", str(tmp_path / "b"), "--out", str(out),
                 "--no-ledger"]) == 0  # fmt: skip
    text = out.read_text()
    assert text.count("### planted-seed0 (a)") == text.count("### planted-seed0 (b)") == 6  # one per question
    figures = [line.split("(")[-1].rstrip(")") for line in text.splitlines() if line.startswith("![")]
    assert len(figures) == len(set(figures)) == 10 and all((tmp_path / f).is_file() for f in figures)


def test_trace_labels_are_unique_even_for_one_directory_name_in_two_places() -> None:
    def trace(workload: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(workload=workload, path=Path(path))

    traces = [trace("mixed_joint", "a/x"), trace("mixed_joint", "b/x"), trace("mixed_joint", "c/y"), trace("w", "z")]
    assert trace_labels(traces) == ["mixed_joint (x)", "mixed_joint (x) #2", "mixed_joint (y)", "w"]


def test_reanalysis_replaces_rows_and_bad_traces_exit_2(planted_report: tuple, tmp_path: Path) -> None:
    _, trace_dir, ledger, _ = planted_report
    before = len(_rows(ledger, "co_burst", "lift"))
    assert main(["trace", "analyze", str(trace_dir), "--out", str(tmp_path / "f"), "--ledger", str(ledger)]) == 0
    assert len(_rows(ledger, "co_burst", "lift")) == before == 1
    assert main(["trace", "analyze", str(tmp_path), "--out", str(tmp_path / "f"), "--no-ledger"]) == 2


def test_step_tracer_expands_tensors_into_rows(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t", {}) as writer:
        tracer = StepTracer(writer)
        tiers = torch.zeros(2, 4, dtype=torch.int64)
        tiers[1, 3] = 1  # layer 1 expert 3 was on the host
        experts = ExpertStep(
            token_request=torch.tensor([0, 1, 1]),
            topk_ids=torch.tensor([[[0, 1], [1, 2], [0, 2]], [[3, 0], [3, 1], [2, 3]]]),
            topk_weights=torch.full((2, 3, 2), 0.5), tier_before=tiers, tag=tiers.clone(),
            bytes=tiers * 4096, wait_ns=tiers * 1000,
        )  # fmt: skip
        kv = KVStep(1, torch.tensor([0, 1, 2]), torch.tensor([[0, 0, 2], [0, 0, 0]]), torch.zeros(2, 3, dtype=int),
                    torch.tensor([[0, 0, 512], [0, 0, 0]]), torch.tensor([[0, 0, 70], [0, 0, 0]]))  # fmt: skip
        tracer.record_step(7, "decode", 100, 200, ["a", "b"], 3, experts, [kv])
    trace = read_trace(tmp_path / "t")
    rows = trace.frame("expert_access")
    assert len(rows) == 12 and rows["bytes"].sum() == 4096 and rows["ns"].sum() == 1000  # the load counted once
    host = rows[rows["tier_before"].astype(str) == "host"]
    assert host[["layer", "expert"]].drop_duplicates().values.tolist() == [[1, 3]] and len(host) == 3
    assert rows["request"].astype(str).tolist()[:6] == ["a", "a", "b", "b", "b", "b"]
    assert rows["router_rank"].tolist()[:2] == [0, 1]
    kv_rows = trace.frame("kv_access")
    assert kv_rows["block"].tolist() == [0, 1, 2, 0, 1, 2] and set(kv_rows["request"].astype(str)) == {"b"}
    assert kv_rows.loc[kv_rows["bytes"] > 0, ["layer", "block"]].values.tolist() == [[0, 2]]
    assert kv_rows["tier_before"].astype(str).tolist()[2] == "disk"


def test_a_recorded_shape_trace_without_io_or_arbitration_is_analysed(tmp_path: Path) -> None:
    """What the engine adapter writes (no I/O, no arbitration, no budgets) still gets every analysis it allows,
    and the report says what is missing."""
    rng = np.random.default_rng(0)
    model = {"num_layers": 2, "num_experts": 4, "top_k": 2, "bytes_per_expert": 1000, "bytes_per_kv_block": 100}
    with TraceWriter(tmp_path / "t", {"model": model, "workload": "adapter"}) as writer:
        tracer = StepTracer(writer)
        for step in range(30):
            tiers = torch.tensor(rng.integers(0, 2, (2, 4)))
            experts = ExpertStep(torch.tensor([0, 1]), torch.tensor(rng.integers(0, 4, (2, 2, 2))),
                                 torch.full((2, 2, 2), 0.5), tiers, tiers, tiers * 1000, tiers * 50_000)  # fmt: skip
            zeros = torch.zeros(2, 3, dtype=torch.int64)
            kv = [
                KVStep(r, torch.arange(3), torch.tensor(rng.integers(0, 2, (2, 3))), zeros, zeros, zeros)
                for r in (0, 1)
            ]
            tracer.record_step(step, "decode", step * 10**6, (step + 1) * 10**6, ["x", "y"], 2, experts, kv)
        writer.append(TraceTable.REQUESTS, request=["x", "y"], request_class=["c", "c"], slo_ttft_ns=None,
                      slo_tpot_ns=[2 * 10**6, None], arrival_ns=[0, 0], first_token_ns=[1, 1],
                      finish_ns=[30 * 10**6] * 2, prompt_tokens=[3, 3], output_tokens=[30, 30])  # fmt: skip
    out = tmp_path / "report.md"
    assert main(["report", "--trace", str(tmp_path / "t"), "--out", str(out), "--no-ledger"]) == 0
    text = out.read_text()
    assert "no arbitration rows" in text and "no reads in its io table" in text
    assert "| nvme-pcie4 (what-if) |" in text and "| measured |" not in text  # nothing to fit a device on


def test_flat_kv_reads_equal_per_request_ones(tmp_path: Path) -> None:
    zeros = torch.zeros(2, 3, dtype=torch.int64)
    tier = torch.tensor([[0, 1, 0], [2, 0, 0]])
    for name, kv in (
        ("per", [KVStep(1, torch.tensor([4, 5, 6]), tier, zeros, tier * 10, tier * 7)]),
        ("flat", KVReads(torch.ones(6, dtype=torch.int64), torch.tensor([0, 0, 0, 1, 1, 1]),
                         torch.tensor([4, 5, 6] * 2),
                         tier.reshape(-1), zeros.reshape(-1), tier.reshape(-1) * 10, tier.reshape(-1) * 7)),
    ):  # fmt: skip
        with TraceWriter(tmp_path / name, {}) as writer:
            StepTracer(writer).record_step(0, "decode", 0, 1, ["a", "b"], 2, None, kv)
    per, flat = (read_trace(tmp_path / n).frame("kv_access") for n in ("per", "flat"))
    assert per.astype(str).to_dict("records") == flat.astype(str).to_dict("records")
    assert per["bytes"].tolist() == [0, 10, 0, 20, 0, 0] and set(per["request"].astype(str)) == {"b"}


def _co_burst_analysis(p_expert: float, p_kv: float, ci: tuple[float, float]) -> object:
    rows = [
        AnalysisRow(Analysis.CO_BURST, "p_expert_miss", p_expert),
        AnalysisRow(Analysis.CO_BURST, "p_kv_miss", p_kv),
        AnalysisRow(Analysis.CO_BURST, "p_both", 0.0),
        AnalysisRow(Analysis.CO_BURST, "p_product", p_expert * p_kv),
        AnalysisRow(Analysis.CO_BURST, "lift", 0.0 if p_kv else float("nan"), "ratio", *ci, params={"num_cells": 9}),
    ]

    class OneResult:
        def result(self, name: str) -> AnalysisResult:
            assert name == "co_burst"
            return AnalysisResult(Analysis.CO_BURST, rows)

    return OneResult()


def test_the_report_says_no_data_when_one_kind_of_miss_never_happened(tmp_path: Path) -> None:
    """A trace without KV misses has no evidence either way: not "compatible with independence"."""
    nan = float("nan")
    no_kv = "\n".join(_q2(_co_burst_analysis(0.6, 0.0, (nan, nan)), tmp_path))
    assert "**no data**" in no_kv and "P(KV miss) = 0" in no_kv and "independence" not in no_kv
    no_interval = "\n".join(_q2(_co_burst_analysis(0.6, 0.1, (nan, nan)), tmp_path))
    assert "**undecided**" in no_interval and "independence" not in no_interval
    apart = "\n".join(_q2(_co_burst_analysis(0.6, 0.1, (0.0, 0.5)), tmp_path))
    assert "**not independent**" in apart
    spans = "\n".join(_q2(_co_burst_analysis(0.6, 0.1, (0.5, 1.5)), tmp_path))
    assert "**compatible with independence**" in spans
