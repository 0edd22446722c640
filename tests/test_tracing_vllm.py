"""``trace import-vllm``: vLLM's routed-experts responses (built to vLLM's layouts, ``tests/vllm_fixture.py``) as a
trace that reads back, carries exactly vLLM's routing, synthesises KV reads from the lengths, says so in its
metadata, and runs through ``trace analyze`` and ``trace simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.cli import main
from fallbackgate.resources import package_dir
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.schema import TraceFormatError
from fallbackgate.tracing.vllm_routing import decode_routed, read_routed_file
from fallbackgate.tracing.vllm_trace import import_vllm
from tests import vllm_fixture as fx

MODEL = str(package_dir("fallbackgate.tinymoe") / "checkpoint")
MOE = [layer for layer in range(fx.NUM_LAYERS) if layer not in fx.DENSE]


def _write(tmp_path: Path, data: list[dict], name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_committed_fixture_is_the_builders_output() -> None:
    assert json.loads(fx.FILE.read_text()) == fx.responses()


def test_payload_is_npy_base64_as_vllm_sends_it() -> None:
    payload = fx.responses()[1]["choices"][0]["routed_experts"]
    decoded = decode_routed(payload, "x")
    prompt, generated = fx.LENGTHS[1]
    assert decoded.shape == (prompt + generated - 1, fx.NUM_LAYERS, fx.TOP_K)
    assert (decoded[:, list(fx.DENSE)] == 0).all()
    with pytest.raises(TraceFormatError, match="not base64 of .npy"):
        decode_routed("bm90IG5weQ==", "x")


@pytest.mark.parametrize("layout", ["full", "split"])
def test_imported_trace_holds_vllms_routing(tmp_path: Path, layout: str) -> None:
    source = _write(tmp_path, fx.responses(layout))
    import_vllm(source, tmp_path / "t", MODEL, block_size=4, step_ns=2_000_000)
    trace = read_trace(tmp_path / "t")
    meta = trace.metadata
    assert meta["source"] == "vllm" and set(meta["synthesized"]) == {"steps", "kv_access", "requests"}
    assert meta["vllm"]["layouts"] == [layout] and meta["model"]["moe_layers"] == MOE
    assert meta["model"]["bytes_per_expert"] == 3 * 192 * 128 * 4 and meta["model"]["num_experts"] == 16
    experts = trace.frame("expert_access")
    assert len(experts) == sum(p + g - 1 for p, g in fx.LENGTHS) * len(MOE) * fx.TOP_K
    assert sorted(experts["layer"].unique().tolist()) == MOE and experts["router_weight"].isna().all()
    for i, (prompt, generated) in enumerate(fx.LENGTHS):
        rows = experts[experts["request"].astype(str) == f"cmpl-{i}"]
        expected = fx.routing(i, prompt + generated - 1)[:, MOE]
        assert rows["expert"].tolist() == expected.reshape(-1).tolist()  # position, layer, rank order
        assert rows["router_rank"].tolist() == [0, 1] * (len(rows) // 2)
        assert (rows["step"] == 0).sum() == prompt * len(MOE) * fx.TOP_K
        assert rows["step"].max() == generated - 1
    steps = trace.frame("steps")
    assert steps["tokens"].tolist()[0] == sum(p for p, _ in fx.LENGTHS)
    assert (steps["end_ns"] - steps["start_ns"] == 2_000_000).all()
    kv = trace.frame("kv_access")
    one = kv[(kv["request"].astype(str) == "cmpl-2") & (kv["layer"] == 0)]
    prompt, generated = fx.LENGTHS[2]
    expected_blocks = [-(-(prompt + s) // 4) for s in range(generated)]  # ceil(context / block size) per step
    assert one.groupby("step")["block"].count().tolist() == expected_blocks
    assert kv["layer"].nunique() == fx.NUM_LAYERS and (kv["tier_before"].astype(str) == "device").all()
    requests = trace.frame("requests").set_index("request")
    assert requests.loc["cmpl-3", "output_tokens"] == 1 and requests.loc["cmpl-3", "finish_ns"] == 2_000_000


def test_positions_match_the_request_lengths_or_the_file_is_refused(tmp_path: Path) -> None:
    bad = fx.full_response(0, 7, 5)
    bad["usage"]["prompt_tokens"], bad["choices"][0]["prompt_token_ids"] = 9, list(range(9))
    with pytest.raises(TraceFormatError, match="11 routed positions for 9 prompt"):
        read_routed_file(_write(tmp_path, [bad]))
    missing = fx.full_response(0, 7, 5)
    del missing["choices"][0]["routed_experts"]
    with pytest.raises(TraceFormatError, match="enable-return-routed-experts"):
        read_routed_file(_write(tmp_path, [missing]))


def test_without_a_model_dense_layers_are_dropped(tmp_path: Path) -> None:
    lines = "\n".join(json.dumps(r) for r in fx.responses())  # JSON lines
    source = tmp_path / "r.jsonl"
    source.write_text(lines)
    import_vllm(source, tmp_path / "t")
    trace = read_trace(tmp_path / "t")
    assert trace.metadata["model"]["moe_layers"] == MOE and "bytes_per_expert" not in trace.metadata["model"]


def test_cli_import_then_analyze_and_simulate(tmp_path: Path) -> None:
    out = tmp_path / "t"
    assert main(["trace", "import-vllm", str(fx.FILE), "--out", str(out), "--model", MODEL]) == 0
    assert main(["trace", "analyze", str(out), "--out", str(tmp_path / "fig"), "--no-ledger"]) == 0
    assert any((tmp_path / "fig").iterdir())
    sim = tmp_path / "sim.json"
    args = ["trace", "simulate", str(out), "--out", str(sim), "--controllers", "exact_lru", "--devices", "nvme"]
    assert main([*args, "--budget-gib", "0.0001", "--jobs", "1"]) == 0
    (result,) = json.loads(sim.read_text())
    assert "error" not in result, result
    assert result["misses_by_tag"].get("expert:exact_load", 0) > 0  # 40 KiB of device memory holds few experts
    assert main(["trace", "import-vllm", str(tmp_path / "absent.json"), "--out", str(tmp_path / "u")]) == 2


def test_object_sizes_equal_the_engines_for_the_same_checkpoint(tmp_path: Path) -> None:
    from fallbackgate.assembly import Overrides, assemble, no_policy
    from fallbackgate.tracing.live import engine_metadata

    import_vllm(fx.FILE, tmp_path / "t", MODEL)
    built = assemble(no_policy(memory={}), Overrides(max_new_tokens=1))
    try:
        engine = engine_metadata(built.engine)["model"]
    finally:
        built.engine.close()
    imported = read_trace(tmp_path / "t").metadata["model"]
    for key in ("bytes_per_expert", "bytes_per_kv_block", "block_size", "num_experts", "moe_layers", "top_k"):
        assert imported[key] == engine[key], key
