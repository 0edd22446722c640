"""Fast tests of the evaluation pieces: engine scoring, parity statistics, tolerances, fail-fast inputs."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from fallbackgate.cli import main
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import PromptError
from fallbackgate.engine.model.scoring import score
from fallbackgate.evals.parity_report import failure_lines, to_markdown
from fallbackgate.evals.parity_stats import TaskItems, aggregate, compare, mcnemar
from fallbackgate.evals.tolerances import load_parity_policy
from fallbackgate.policy import PolicyError
from tests.checkpoints import make_checkpoint

EXACT_POLICY = pathlib.Path(__file__).resolve().parents[1] / "fallbackgate" / "policies" / "exact.yaml"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ckpt") / "qwen3_moe"
    make_checkpoint("qwen3_moe", path)
    return path


def test_scoring_batches_through_engine_and_matches_exact_pass(ckpt: pathlib.Path) -> None:
    engine = Engine(EngineConfig(model_dir=str(ckpt), max_num_batched_tokens=64, max_num_seqs=4), ExactLRUController())
    torch.manual_seed(0)
    items = [
        (torch.randint(3, 300, (n,)).tolist(), torch.randint(3, 300, (k,)).tolist())
        for n, k in [(5, 3), (40, 30), (7, 1), (90, 12), (3, 2), (20, 20)]
    ]
    sizes: list[int] = []
    results = score(engine, items, max_in_flight=6, on_step=lambda plan, _: sizes.append(len(plan.request_ids)))
    assert max(sizes) > 1  # several requests share a forward (real batching), prefill chunked at 64 tokens
    for (ctx, cont), r in zip(items, results, strict=True):
        exact = engine.exact_logits(ctx + cont)[len(ctx) - 1 : len(ctx) + len(cont) - 1]
        logp = torch.log_softmax(exact, -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
        assert r.logprob == pytest.approx(float(logp.sum()), abs=1e-4)
        assert r.is_greedy == bool((exact.argmax(-1) == torch.tensor(cont)).all())
    with pytest.raises(PromptError, match="num_scored_tokens"):
        engine.add_request([5, 6], num_scored_tokens=3)


def test_statistics_by_hand() -> None:
    assert mcnemar([1, 1, 1, 0, 0], [0, 0, 1, 1, 0]) == {
        "only_exact_right": 2,
        "only_policy_right": 1,
        "p_value": 1.0,
    }
    m = mcnemar([1] * 8 + [0] * 2, [0] * 8 + [0] * 2)  # 8 discordant, all one way: p = 2 / 2^8
    assert m["p_value"] == pytest.approx(2 / 256)
    assert aggregate("word_perplexity", [(-10.0, 5), (-2.0, 1)]) == pytest.approx(math.exp(2.0))
    assert aggregate("bits_per_byte", [(-math.log(2) * 3, 3)]) == pytest.approx(1.0)
    e = TaskItems("acc", "none", True, [0, 1, 2, 3], [1, 1, 0, 1], [0, 2, 1, 3])
    p = TaskItems("acc", "none", True, [0, 1, 2, 3], [1, 0, 0, 1], [0, 1, 1, 3])
    r = compare(e, p, samples=500)
    assert (r["exact_score"], r["policy_score"], r["difference"], r["drop"]) == (0.75, 0.5, -0.25, 0.25)
    assert r["agreement"] == 0.75 and r["disagreeing_doc_ids"] == [1]
    assert -1.0 <= r["ci"][0] <= -0.25 <= r["ci"][1] <= 0.0
    same = compare(e, e, samples=200)
    assert same["ci"] == [0.0, 0.0] and same["agreement"] == 1.0 and same["difference"] == 0.0


def test_report_names_task_gap_and_interval() -> None:
    e = TaskItems("acc", "none", True, [0, 1, 2, 3], [1, 1, 1, 1], [0, 0, 0, 0])
    p = TaskItems("acc", "none", True, [0, 1, 2, 3], [1, 0, 0, 1], [0, 1, 1, 0])
    from fallbackgate.evals.parity import judge
    from fallbackgate.evals.tolerances import TaskTolerance

    r = compare(e, p, samples=500)
    r.update(task="fg_cloze", drift=None)
    r["checks"] = judge(r, TaskTolerance(max_score_drop=0.1, min_agreement=0.9, max_ppl_ratio=1.0))
    r["passed"] = all(c["passed"] for c in r["checks"])
    report = {
        "policy": "p.yaml",
        "controller": "x",
        "mode": "enforce",
        "model": "m",
        "limit": 4,
        "ledger": None,
        "passed": r["passed"],
        "tasks": [r],
    }
    lines = failure_lines(report)
    assert len(lines) == 2 and lines[0].startswith("FAIL fg_cloze: score drop 0.5000 (limit <= 0.1000)")
    assert "gap -0.5000" in lines[0] and "95% CI [" in lines[0]
    assert "# Parity: FAIL" in to_markdown(report)
    r["checks"] = judge(r, TaskTolerance(max_score_drop=0.6, min_agreement=0.5, max_ppl_ratio=1.0))
    assert all(c["passed"] for c in r["checks"])


def test_parity_section_errors_name_the_field(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("controller: {kind: nope}\nparity: {tasks: {fg_cloze: {min_agreement: 2}}, bogus: 1}\n")
    with pytest.raises(PolicyError) as info:
        load_parity_policy(bad)
    text = str(info.value)
    assert "controller.kind" in text and "parity.tasks.fg_cloze.min_agreement" in text and "parity.bogus" in text
    policy, spec = load_parity_policy(EXACT_POLICY)
    assert policy.controller.kind == "exact_lru" and spec.for_task("fg_cloze").min_agreement == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "fg_cloze,no_such_task"], "unknown task(s) ['no_such_task']"),
        (["--tasks", "fg_cloze", "--data-dir", "/nonexistent-dir"], "data file /nonexistent-dir/cloze.jsonl"),
        (["--tasks", "fg_cloze", "--policy", "BAD"], "classes.default.budget.max_mean_kl"),
        (["--tasks", "fg_cloze", "--model", "/nonexistent-model"], "has no config.json"),
    ],
)
def test_bad_inputs_fail_before_model_work(
    args: list[str],
    message: str,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: {default: {budget: {max_mean_kl: -1}}}\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    if "--policy" not in args:
        args = ["--policy", str(EXACT_POLICY)] + args

    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(Engine, "__init__", no_model)
    assert main(["parity", *args]) == 2
    assert message in capsys.readouterr().err


def test_task_yamls_render_with_absolute_data_paths(tmp_path: pathlib.Path) -> None:
    from fallbackgate.evals.task_dir import LOCAL_TASKS, render_include_dir

    out = render_include_dir(dest=tmp_path)
    names = sorted(p.stem for p in out.glob("*.yaml"))
    assert names == sorted(LOCAL_TASKS)
    text = (out / "fg_cloze.yaml").read_text()
    assert "__FALLBACKGATE_DATA__" not in text and str(pathlib.Path(__file__).resolve().parents[1]) in text
    assert json.loads((pathlib.Path(text.split("test: ")[1].split()[0])).read_text().splitlines()[0])["id"]
