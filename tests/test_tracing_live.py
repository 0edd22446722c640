"""``run --trace DIR`` / ``serve --trace DIR``: the live trace of the bundled model under a budget that forces
exact loads and KV spills, checked row by row against the ledger the same run wrote."""

from __future__ import annotations

import json
import math
import pathlib
import sqlite3

import numpy as np
import pytest
import torch

from fallbackgate.cli import main
from fallbackgate.engine.messages import RoutingCall, StepCapture
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.tracing import read_trace
from fallbackgate.tracing.access_columns import expert_columns, kv_columns

PROMPTS = [f"request {i}: the quick brown fox jumps over the lazy dog and then it runs far away " * (1 + i % 3)
           for i in range(8)]  # fmt: skip


def test_expert_columns_put_each_use_s_tag_on_its_rows_and_its_bytes_on_the_first() -> None:
    # layer 1: tokens 0,1 of request a, token 2 of request b; top-2
    ids = torch.tensor([[3, 5], [3, 7], [3, 5]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    call = RoutingCall(1, ["a", "b"], torch.tensor([0, 0, 1]), ids, weights, named_ids=[5])
    cap = StepCapture(0, 1, [call], expert_served=[(0, 3, "a", Tier.HOST, Tag.EXACT_LOAD, 1000, 77)])
    cols = expert_columns(4, cap, ["a", "b"], {"a": 0, "b": 1})
    assert cols["expert"].tolist() == [3, 5, 3, 7, 3, 5]
    assert cols["request"].index.tolist() == [0, 0, 0, 0, 1, 1]
    assert cols["router_rank"].tolist() == [0, 1, 0, 1, 0, 1]
    exact, resident = list(Tag).index(Tag.EXACT_LOAD), list(Tag).index(Tag.RESIDENT)
    assert cols["tag"].tolist() == [exact, resident, exact, resident, resident, resident]  # b's use of 3: resident
    assert cols["bytes"].tolist() == [1000, 0, 0, 0, 0, 0] and cols["ns"].tolist() == [77, 0, 0, 0, 0, 0]
    assert cols["tier_before"].tolist() == [1, 0, 1, 0, 0, 0]
    assert cols["is_predicted"].tolist() == [False, True, False, False, False, True]
    np.testing.assert_allclose(cols["router_weight"], weights.reshape(-1).numpy())


def test_expert_columns_join_calls_of_different_token_counts_in_order() -> None:
    # a prefill call of 3 tokens then a decode call of 1 (bf16 weights, as the model makes them), top-2
    first = RoutingCall(0, ["a"], torch.tensor([0, 0, 0]), torch.tensor([[1, 2], [3, 4], [5, 6]]),
                        torch.tensor([[0.5, 0.25], [0.75, 0.125], [1.0, 0.0]], dtype=torch.bfloat16))  # fmt: skip
    second = RoutingCall(1, ["b"], torch.tensor([0]), torch.tensor([[7, 0]]),
                         torch.tensor([[0.625, 0.375]], dtype=torch.bfloat16))  # fmt: skip
    cols = expert_columns(np.array([2, 3]), StepCapture(0, 1, [first, second]), ["a", "b"], {"a": 0, "b": 1})
    assert cols["expert"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert cols["router_weight"].dtype == np.float32
    assert cols["router_weight"].tolist() == [0.5, 0.25, 0.75, 0.125, 1.0, 0.0, 0.625, 0.375]
    assert cols["step"].tolist() == [2] * 6 + [3] * 2 and cols["layer"].tolist() == [0] * 6 + [1] * 2
    assert cols["request"].index.tolist() == [0] * 6 + [1] * 2
    assert cols["router_rank"].tolist() == [0, 1] * 4


def test_kv_columns_cover_every_block_of_every_layer_and_mark_the_served_ones() -> None:
    cap = StepCapture(0, 1, kv_reads=[("a", 2), ("b", 3)],
                      kv_served={("b", 1, 2): (Tier.DISK, Tag.EXACT_LOAD, 8192, 500)})  # fmt: skip
    cols = kv_columns(0, cap, ["a", "b"], {"a": 0, "b": 1}, num_layers=2)
    assert cols["request"].index.tolist() == [0] * 4 + [1] * 6
    assert cols["layer"].tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert cols["block"].tolist() == [0, 1, 0, 1, 0, 1, 2, 0, 1, 2]
    assert cols["bytes"].tolist() == [0] * 9 + [8192] and cols["tier_before"].tolist() == [0] * 9 + [2]
    with pytest.raises(ValueError, match="not among the step's reads"):
        kv_columns(0, StepCapture(0, 1, kv_reads=[("a", 1)], kv_served={("a", 0, 1): cap.kv_served[("b", 1, 2)]}),
                   ["a"], {"a": 0}, 2)  # fmt: skip


def test_run_trace_refuses_a_non_empty_directory_and_no_ledger(tmp_path: pathlib.Path, capsys) -> None:
    (tmp_path / "tr").mkdir()
    (tmp_path / "tr" / "x").write_text("")
    assert main(["run", "--trace", str(tmp_path / "tr"), "--ledger", str(tmp_path / "l.sqlite"), "--quiet"]) == 2
    assert "must be a new or empty directory" in capsys.readouterr().err
    assert main(["run", "--trace", str(tmp_path / "t2"), "--no-ledger", "--quiet"]) == 2
    assert "--trace needs the ledger" in capsys.readouterr().err


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path, int]:
    tmp = tmp_path_factory.mktemp("traced")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": f"r{i}"}) + "\n" for i, p in enumerate(PROMPTS)))
    out, ledger, trace = tmp / "run.json", tmp / "ledger.sqlite", tmp / "trace"
    status = main(["run", "--prompts", str(prompts), "--max-new-tokens", "8", "--device-budget-mb", "1.5",
                   "--ledger", str(ledger), "--json", str(out), "--trace", str(trace), "--quiet"])  # fmt: skip
    assert status == 0
    return trace, ledger, json.loads(out.read_text())["run_id"]


def _ledger(ledger: pathlib.Path, sql: str, *args: object) -> list[tuple]:
    with sqlite3.connect(ledger) as conn:
        return conn.execute(sql, args).fetchall()


@pytest.mark.slow
def test_run_trace_matches_the_ledger(traced_run: tuple[pathlib.Path, pathlib.Path, int]) -> None:
    path, ledger, run_id = traced_run
    trace = read_trace(path)
    model = trace.metadata["model"]
    assert (model["num_moe_layers"], model["top_k"], model["num_experts"]) == (4, 2, 16)
    assert _ledger(ledger, "select trace_path from runs where id = ?", run_id) == [(str(path.resolve()),)]
    steps = trace.frame("steps").set_index("step")
    ledger_steps = dict(_ledger(ledger, "select step_id, num_tokens from steps where run_id = ?", run_id))
    assert steps["tokens"].to_dict() == ledger_steps and (steps["end_ns"] > steps["start_ns"]).all()
    experts, kv = trace.frame("expert_access"), trace.frame("kv_access")
    assert len(experts) == int(steps["tokens"].sum()) * model["top_k"] * model["num_moe_layers"]
    events = _ledger(ledger, "select object_kind, tag, sum(bytes_moved), sum(count) from events where run_id = ? "
                             "group by object_kind, tag", run_id)  # fmt: skip
    by_tag = {(k, t): b for k, t, b, _ in events}
    assert by_tag[("expert", "exact_load")] > 0 and by_tag[("kv_block", "exact_load")] > 0  # loads and spills
    for kind, frame in (("expert", experts), ("kv_block", kv)):
        traced = frame.groupby(frame["tag"].astype(str))["bytes"].sum()
        assert {t: int(b) for t, b in traced.items() if b} == {t: b for (k, t), b in by_tag.items() if k == kind and b}
    uses = experts.drop_duplicates(["step", "request", "layer", "expert"]).groupby(experts["tag"].astype(str)).size()
    ledger_uses = {t: c for k, t, _, c in events if k == "expert"}  # one ledger object per use
    counted = _ledger(ledger, "select sum(num_resident_expert_uses) from step_requests where run_id = ?", run_id)
    ledger_uses["resident"] = ledger_uses.get("resident", 0) + int(counted[0][0] or 0)  # exact resident: counts
    assert uses.to_dict() == ledger_uses
    off_device = kv[kv["tag"].astype(str) != "resident"].groupby(kv["tag"].astype(str)).size().to_dict()
    assert off_device == {t: c for k, t, _, c in events if k == "kv_block" and t != "resident"}
    assert ((kv["tier_before"].astype(str) == "device") == (kv["tag"].astype(str) == "resident")).all()
    io = trace.frame("io")  # the serving run's transfers only: the audit's checkpoint reads come after it
    reads = io[io["op"].astype(str) == "read"].groupby(io["object_kind"].astype(str))["bytes"].sum()
    assert reads["kv_block"] == by_tag[("kv_block", "exact_load")]
    assert by_tag[("expert", "exact_load")] <= reads["expert"] <= 1.05 * by_tag[("expert", "exact_load")]


@pytest.mark.slow
def test_run_trace_kv_covers_each_request_s_blocks_per_layer_per_step(traced_run) -> None:
    path, ledger, run_id = traced_run
    trace = read_trace(path)
    kv, block_size = trace.frame("kv_access"), trace.metadata["model"]["block_size"]
    rows = _ledger(ledger, "select step_id, request_id, start_position, num_tokens, kv_resident_reads "
                           "from step_requests where run_id = ?", run_id)  # fmt: skip
    groups = {key: g["block"].tolist() for key, g in kv.groupby(["step", kv["request"].astype(str), "layer"])}
    resident = kv[kv["tag"].astype(str) == "resident"].groupby(["step", kv["request"].astype(str), "layer"]).size()
    resumed = {(s, r, layer): n for s, r, layer, n in _ledger(
        ledger, "select step_id, request_id, layer, sum(count) from events where run_id = ? and note = ? "
                "group by step_id, request_id, layer", run_id, "resume: tail block")}  # fmt: skip
    assert resumed  # the budget preempts and resumes: a restored tail block is read on device after its load
    for step, request, start, num, reads in rows:
        num_blocks = math.ceil((start + num) / block_size)
        per_layer = [int(n) for n in reads.split(",")] if reads else [0] * 5
        for layer in range(trace.metadata["model"]["num_layers"]):
            assert groups[(step, request, layer)] == list(range(num_blocks))
            # the ledger counts a restored tail block twice (its load event, then a device read); the trace once,
            # with the tag that made it usable
            expected = per_layer[layer] - resumed.get((step, request, layer), 0)
            assert resident.get((step, request, layer), 0) == expected
    assert len(groups) == len(rows) * trace.metadata["model"]["num_layers"]


@pytest.mark.slow
def test_run_trace_requests_equal_the_ledger_s_and_analyze_runs(traced_run, tmp_path: pathlib.Path) -> None:
    path, ledger, run_id = traced_run
    requests = read_trace(path).frame("requests").set_index("request")
    rows = _ledger(ledger, "select request_id, request_class, num_prompt_tokens, num_output_tokens, ttft_s, tpot_s "
                           "from requests where run_id = ?", run_id)  # fmt: skip
    assert sorted(requests.index) == sorted(r[0] for r in rows)
    for request, cls, prompt, output, ttft, tpot in rows:
        row = requests.loc[request]
        assert (row["request_class"], row["prompt_tokens"], row["output_tokens"]) == (cls, prompt, output)
        assert (row["first_token_ns"] - row["arrival_ns"]) / 1e9 == pytest.approx(ttft, abs=2e-6)
        assert (row["finish_ns"] - row["first_token_ns"]) / 1e9 / (output - 1) == pytest.approx(tpot, abs=2e-6)
    out = tmp_path / "analysis"
    out.mkdir()
    assert main(["trace", "analyze", str(path), "--out", str(out), "--ledger", str(ledger), "--run", str(run_id)]) == 0
    assert list(out.glob("*.png"))
    assert _ledger(ledger, "select count(*) from trace_analyses where trace_path = ?", str(path.resolve()))[0][0] > 0


@pytest.mark.slow
def test_serve_trace_writes_a_valid_trace(tmp_path: pathlib.Path) -> None:
    from tests.test_server import Server

    trace = tmp_path / "trace"
    server = Server(str(tmp_path / "ledger.sqlite"), "--trace", str(trace), "--audit-rate", "0")
    try:
        client = server.client()
        for prompt in ("Once upon a time", "The cat sat"):
            client.completions.create(model="checkpoint", prompt=prompt, max_tokens=4, temperature=0)
    finally:
        server.stop()
    got = read_trace(trace)
    requests = got.frame("requests")
    assert len(requests) == 2 and (requests["output_tokens"] == 4).all()
    steps, experts = got.frame("steps"), got.frame("expert_access")
    assert len(experts) == int(steps["tokens"].sum()) * got.metadata["model"]["top_k"] * 4
    assert set(got.frame("kv_access")["request"].astype(str)) == set(requests["request"])


def test_arbitrations_become_one_row_per_option_with_the_chosen_one_s_measured_arrival(tmp_path) -> None:
    from types import SimpleNamespace

    from fallbackgate.controllers.arbitration import Arbitration, ArbitrationOption
    from fallbackgate.engine.messages import KVStaging, StepKind, StepPlan
    from fallbackgate.tracing.live import LiveTracer
    from fallbackgate.tracing.writer import TraceWriter

    tracer = LiveTracer.__new__(LiveTracer)
    tracer.writer, tracer.num_decisions = TraceWriter(tmp_path / "t", {}), 0
    tracer.engine = SimpleNamespace(kv_store=SimpleNamespace(bytes_per_block=8192),
                                    expert_store=SimpleNamespace(bytes_per_expert=1000))  # fmt: skip
    options = (ArbitrationOption(Tag.EXACT_LOAD, 2e-3, 0.0, False), ArbitrationOption(Tag.KV_DEQUANT, 1e-3, 0.25, True),
               ArbitrationOption(Tag.RECOMPUTE, 3e-3, 0.0, True))  # fmt: skip
    decided = Arbitration(7, ("a", 2, 1), Tag.KV_DEQUANT, "late", options=options)
    plan = StepPlan(7, StepKind.DECODE, ["a"], {"a": 1}, {"a": 40})
    result = SimpleNamespace(step_id=7, kv_stagings=[KVStaging("a", 2, 1, Tag.KV_DEQUANT, 2200, 0.0015)])
    tracer._arbitrations(plan, result, [decided])
    tracer.writer.close()
    rows = read_trace(tmp_path / "t").frame("arbitration")
    assert rows["option"].astype(str).tolist() == ["kv_first", "dequant", "recompute"]
    assert rows["predicted_ns"].tolist() == [2_000_000, 1_000_000, 3_000_000]
    assert rows["bytes"].tolist() == [8192, 2200, 0] and rows["is_chosen"].tolist() == [False, True, False]
    assert rows["outcome_ns"].tolist()[1] == 1_500_000 and rows["outcome_ns"].isna().tolist() == [True, False, True]
    assert set(rows["context_tokens"]) == {41} and set(rows["phase"].astype(str)) == {"decode"}


@pytest.mark.slow
def test_run_trace_of_disk_tiered_experts_marks_what_the_read_ahead_predictor_named(tmp_path: pathlib.Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": f"r{i}"}) + "\n" for i, p in enumerate(PROMPTS)))
    ledger, path = tmp_path / "ledger.sqlite", tmp_path / "trace"
    assert main(["run", "--prompts", str(prompts), "--max-new-tokens", "6", "--device-budget-mb", "4",
                 "--io-threads", "2", "--ledger", str(ledger), "--trace", str(path),
                 "--quiet"]) == 0  # fmt: skip
    experts = read_trace(path).frame("expert_access")
    tiers = experts["tier_before"].astype(str)
    assert (tiers == "disk").any() and (tiers == "device").any()  # experts come from the checkpoint's files
    first_layer = experts["layer"].min()
    assert experts["is_predicted"].any() and not experts.loc[experts["layer"] == first_layer, "is_predicted"].any()
    events = _ledger(ledger, "select tag, sum(bytes_moved) from events where object_kind = 'expert' group by tag")
    traced = experts.groupby(experts["tag"].astype(str))["bytes"].sum()
    assert {t: int(b) for t, b in traced.items() if b} == {t: b for t, b in events if b}
