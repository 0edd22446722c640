"""How a trace's steps price a request's TPOT: over the steps between its first token and its finish, each with
the host time before it, so that nothing the cache does not change (and no idle wait for arrivals) moves it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fallbackgate.tracing import TraceTable, TraceWriter
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.timeline import build_timeline
from fallbackgate.tracing.validate import recorded_outcome, validate

MS = 1_000_000
MODEL = {"num_layers": 1, "num_experts": 2, "top_k": 1, "bytes_per_expert": 1000, "bytes_per_kv_block": 100}
IDLE_NS = 1_000 * MS  # the engine waits a second for the second request to arrive


def _starts(period_ns: int = MS) -> list[int]:
    """Steps 0-3 serve request a, 4-7 request b, one every `period_ns`; the engine idles before step 4."""
    return [i * period_ns + (IDLE_NS if i >= 4 else 0) for i in range(8)]


def _write(
    path: Path,
    tails_ns: tuple[int, int] = (50_000, 50_000),
    step_ns: int = 800_000,
    period_ns: int = MS,
    **meta: object,
) -> None:
    """Each request's first token `tails_ns[0]` before its first step's end, its finish `tails_ns[1]` before
    its last step's end (the engine stamps a token while the step is still recording)."""
    starts = _starts(period_ns)
    ends = [s + step_ns for s in starts]
    owner = ["a"] * 4 + ["b"] * 4
    metadata = {"model": MODEL, "controller": "exact_lru", "budgets": {"device_bytes": 10**6}, **meta}
    with TraceWriter(path, metadata) as writer:
        writer.append(TraceTable.STEPS, step=list(range(8)), phase=["prefill"] + ["decode"] * 3 + ["prefill"]
                      + ["decode"] * 3, start_ns=starts, end_ns=ends, batch=[1] * 8, tokens=[1] * 8)  # fmt: skip
        writer.append(TraceTable.EXPERT_ACCESS, step=list(range(8)), request=owner, layer=[0] * 8, expert=[0] * 8,
                      router_rank=[0] * 8, router_weight=[1.0] * 8, tier_before=["device"] * 8,
                      tag=["resident"] * 8, bytes=[0] * 8, ns=[0] * 8, is_predicted=[False] * 8)  # fmt: skip
        writer.append(TraceTable.KV_ACCESS, step=list(range(8)), request=owner, layer=[0] * 8, block=[0] * 8,
                      content_hash=None, tier_before=["device"] * 8, tag=["resident"] * 8, bytes=[0] * 8,
                      ns=[0] * 8)  # fmt: skip
        writer.append(TraceTable.REQUESTS, request=["a", "b"], request_class=["c", "c"], slo_ttft_ns=None,
                      slo_tpot_ns=[None, None], arrival_ns=[0, starts[4]],
                      first_token_ns=[ends[0] - tails_ns[0], ends[4] - tails_ns[0]],
                      finish_ns=[ends[3] - tails_ns[1], ends[7] - tails_ns[1]], prompt_tokens=[4, 4],
                      output_tokens=[4, 4])  # fmt: skip


def test_tpot_is_priced_over_the_requests_own_window_not_the_idle_time_after_it(tmp_path: Path) -> None:
    _write(tmp_path / "t")
    trace = read_trace(tmp_path / "t")
    timeline = build_timeline(trace)
    outcome = timeline.outcome(timeline.compute_ns)  # nothing missed: every step lasts its recorded time
    assert recorded_outcome(trace)["mean_tpot_ms"] == pytest.approx(1.0)  # (finish - first token) / 3
    assert outcome["mean_tpot_ms"] == pytest.approx(1.0)  # 3 steps of 0.8 ms, each after 0.2 ms of host time
    assert outcome["p99_tpot_ms"] == pytest.approx(1.0)
    assert sorted(timeline.decode_pairs[:, 0].tolist()) == [1, 2, 3, 5, 6, 7]


def test_a_recorded_run_simulated_with_nothing_missing_predicts_its_own_tpot(tmp_path: Path) -> None:
    _write(tmp_path / "t", tails_ns=(30_000, 70_000))  # unequal tails: the window's ends differ by 40 us
    device = DeviceModel("flat", 100_000, 2e9)
    result = validate(str(tmp_path / "t"), device=device)
    assert result["measured"]["mean_tpot_ms"] == pytest.approx((3 * MS - 40_000) / 3 / MS)
    assert result["predicted"]["mean_tpot_ms"] == pytest.approx(1.0)  # the cold read is in step 0, before a's window
    assert result["predicted"]["stall_s"] == pytest.approx(device.read_ns(MODEL["bytes_per_expert"]) / 1e9)
    assert result["within_bound"]


def test_another_run_is_predicted_with_its_own_configuration_from_this_trace(tmp_path: Path) -> None:
    """``validate(..., target=)``: the target's controller, budget and split over this trace's accesses, against
    the target's measured TPOT (here its steps are 0.2 ms slower, which this trace cannot know)."""
    _write(tmp_path / "source")
    _write(tmp_path / "target", step_ns=1_000_000, period_ns=1_200_000, controller="static_split",
           budgets={"device_bytes": 2 * 10**6, "expert_fraction": 0.7})  # fmt: skip
    result = validate(
        str(tmp_path / "source"), device=DeviceModel("flat", 100_000, 2e9), target=str(tmp_path / "target")
    )
    assert (result["controller"], result["budget_bytes"], result["expert_fraction"]) == ("static_split", 2 * 10**6, 0.7)
    assert result["measured"]["mean_tpot_ms"] == pytest.approx(1.2)  # the target's: a step every 1.2 ms
    assert result["predicted"]["mean_tpot_ms"] == pytest.approx(1.0)  # the source's
    assert result["tpot_error"] == pytest.approx(1.0 / 1.2 - 1) and result["target"] == str(tmp_path / "target")


def test_requests_without_a_tpot_are_left_out_as_the_measurement_leaves_them_out(tmp_path: Path) -> None:
    """A one-token request and one that never finished, both running beside a in steps 1-3: no TPOT window."""
    _write(tmp_path / "t")
    trace = read_trace(tmp_path / "t")
    extra = trace.frame(TraceTable.EXPERT_ACCESS).iloc[[1, 2, 3]]
    with TraceWriter(tmp_path / "u", trace.metadata) as writer:
        for table in (TraceTable.STEPS, TraceTable.KV_ACCESS, TraceTable.REQUESTS):
            writer.append(
                table, **{c: trace.tables[table].column(c).to_pylist() for c in trace.tables[table].column_names}
            )
        experts = trace.tables[TraceTable.EXPERT_ACCESS].to_pydict()
        for name in ("one", "open"):
            for column, values in experts.items():
                values += [name] * 3 if column == "request" else extra[column].tolist()
        writer.append(TraceTable.EXPERT_ACCESS, **experts)
        writer.append(TraceTable.REQUESTS, request=["one", "open"], request_class=["c", "c"], slo_ttft_ns=None,
                      slo_tpot_ns=[None, None], arrival_ns=[0, 0], first_token_ns=[900_000, 900_000],
                      finish_ns=[900_000, None], prompt_tokens=[4, 4], output_tokens=[1, 3])  # fmt: skip
    timeline = build_timeline(read_trace(tmp_path / "u"))
    assert sorted(timeline.decode_pairs[:, 0].tolist()) == [1, 2, 3, 5, 6, 7]  # a's and b's windows only
    assert timeline.outcome(timeline.compute_ns)["mean_tpot_ms"] == pytest.approx(1.0)
