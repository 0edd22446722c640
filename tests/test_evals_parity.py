"""End-to-end parity: exact policy vs exact baseline, an approximate policy against tight and loose tolerances,
and the adapter against lm-eval's own hf model (slow)."""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest

from fallbackgate.cli import main
from fallbackgate.evals.parity import ParityConfig, judge, prepare, run_parity
from fallbackgate.evals.tolerances import TaskTolerance
from tests.checkpoints import make_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXACT_POLICY = ROOT / "fallbackgate" / "policies" / "exact.yaml"
KV_POLICY = ROOT / "evals" / "policies" / "ci_kv_int4.yaml"
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ckpt") / "qwen3_moe"
    make_checkpoint("qwen3_moe", path)
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The first items of the bundled data, shortened so the random test model runs them in seconds."""
    out = tmp_path_factory.mktemp("data")
    for name, field, keep in (("cloze", None, 0), ("rolling_ppl", "text", 240), ("name_completion", "context", -160)):
        rows = [json.loads(line) for line in (ROOT / "evals" / "data" / f"{name}.jsonl").read_text().splitlines()[:3]]
        for row in rows:
            if field:
                row[field] = row[field][:keep] if keep > 0 else row[field][keep:]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_exact_policy_agrees_with_exact_baseline_on_every_item(
    ckpt: pathlib.Path, data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    config = ParityConfig(
        str(EXACT_POLICY),
        ["fg_cloze", "fg_names"],
        limit=3,
        model_dir=str(ckpt),
        data_dir=str(data_dir),
        ledger=f"sqlite:///{tmp_path / 'ledger.db'}",
    )
    report = run_parity(prepare(config))
    assert report["passed"]
    for task in report["tasks"]:
        assert task["num_items"] == 3
        assert task["agreement"] == 1.0 and task["difference"] == 0.0 and task["ci"] == [0.0, 0.0]
        assert task["exact_score"] == task["policy_score"]
        assert task["drift"]["audited_requests"] > 0 and task["drift"]["top1_agreement"] == 1.0
        assert task["drift"]["max_kl"] < 1e-6
        assert set(task["drift"]["tags"]) <= {"resident", "exact_load"}
        assert task["gate"]["passed"]


def test_approximate_policy_fails_tight_and_passes_loose_tolerances(
    ckpt: pathlib.Path, data_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    tight = tmp_path / "tight.yaml"
    text = KV_POLICY.read_text().split("parity:")[0]
    tight.write_text(text + "parity:\n  default: {max_score_drop: 0.0, min_agreement: 1.0, max_ppl_ratio: 1.0}\n")
    common = ["--tasks", "fg_rolling_ppl", "--limit", "3", "--model", str(ckpt), "--data-dir", str(data_dir)]
    common += ["--force", "kv_dequant", "--chunk-tokens", "16", "--ledger", f"sqlite:///{tmp_path / 'ledger.db'}"]
    assert main(["parity", "--policy", str(tight), *common, "--report-dir", str(tmp_path / "tight")]) == 1
    err = capsys.readouterr().err
    fails = [line for line in err.splitlines() if line.startswith("FAIL fg_rolling_ppl: ")]
    assert any(line.startswith("FAIL fg_rolling_ppl: perplexity ratio 1.0") for line in fails), err[-600:]
    assert any(line.startswith("FAIL fg_rolling_ppl: agreement 0.") for line in fails), err[-600:]
    assert "word_perplexity exact" in err and "gap " in err and "95% CI [" in err
    report = json.loads((tmp_path / "tight" / "parity.json").read_text())
    task = report["tasks"][0]
    assert not report["passed"] and task["drift"]["tags"].get("kv_dequant", 0) > 0
    assert task["drift"]["mean_kl"] > 1e-6  # the int4 reads really changed the logits
    assert (tmp_path / "tight" / "parity.md").read_text().startswith("# Parity: FAIL")
    assert main(["parity", "--policy", str(KV_POLICY), *common, "--report-dir", str(tmp_path / "loose")]) == 0
    loose = json.loads((tmp_path / "loose" / "parity.json").read_text())
    assert loose["passed"] and loose["tasks"][0]["ppl_ratio"] == pytest.approx(task["ppl_ratio"])


@pytest.mark.slow
def test_adapter_on_exact_policy_matches_lm_eval_hf_model(ckpt: pathlib.Path, data_dir: pathlib.Path) -> None:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from fallbackgate.evals.lm_adapter import FallbackgateLM
    from fallbackgate.evals.task_dir import render_include_dir

    trained = ROOT / "fallbackgate" / "tinymoe" / "checkpoint"
    model = trained if (trained / "config.json").is_file() else ckpt
    data = None if model == trained else data_dir
    tasks = ["fg_cloze", "fg_rolling_ppl", "fg_names"]
    include = str(render_include_dir(data))
    ours = FallbackgateLM(pretrained=str(model), policy=str(EXACT_POLICY), ledger="none")
    hf = HFLM(pretrained=str(model), dtype="float32", batch_size=8, max_length=ours.max_length, device="cpu")
    results = {}
    for name, lm in (("fallbackgate", ours), ("hf", hf)):
        manager = TaskManager(include_path=include, include_defaults=False)
        results[name] = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=20)["results"]
    scores = {
        name: {(t, k): float(v) for t in tasks for k, v in res[t].items() if "," in k and "stderr" not in k}
        for name, res in results.items()
    }
    print(json.dumps({f"{t} {k}": [v, scores["hf"][(t, k)]] for (t, k), v in scores["fallbackgate"].items()}))
    # The adapter scores a window in one forward, as hf does: accuracies are identical and perplexities agree
    # to fp32 rounding (hf pads a batch, the engine packs it: the sums differ in the 7th significant digit).
    assert scores["fallbackgate"] and scores["fallbackgate"].keys() == scores["hf"].keys()
    for key, ours in scores["fallbackgate"].items():
        assert math.isclose(ours, scores["hf"][key], rel_tol=1e-6), (key, ours, scores["hf"][key])
        if "acc" in key[1] or "exact_match" in key[1]:
            assert ours == scores["hf"][key], key


def test_exact_perplexity_parity_allows_only_the_dtypes_numeric_floor() -> None:
    exact = TaskTolerance(max_score_drop=0.0, min_agreement=1.0, max_ppl_ratio=1.0)
    summation_order = {"ppl_ratio": 1.0000001, "drop": 0.0, "agreement": 1.0}  # seen between batch shapes
    [ratio, _] = judge(summation_order, exact, "float32")
    assert ratio["passed"] and ratio["numeric_floor"] == 1e-6
    real_drift = {"ppl_ratio": 1.00001, "drop": 0.0, "agreement": 1.0}
    assert not judge(real_drift, exact, "float32")[0]["passed"]
    assert judge(real_drift, exact, "bfloat16")[0]["passed"]  # 16-bit sums differ by more
    assert not judge({"ppl_ratio": 1.01, "drop": 0.0, "agreement": 1.0}, exact, "bfloat16")[0]["passed"]
