"""lm-eval as documented: `fallbackgate lm-eval ...` (lm-eval's own CLI) and `simple_evaluate(model="fallbackgate")`."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.cli import main
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import open_ledger


@pytest.mark.slow
def test_lm_eval_cli_runs_the_shipped_task_and_reports_the_gate(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger, out = tmp_path / "l.sqlite", tmp_path / "out"
    out.mkdir()
    args = [
        "lm-eval",
        "--model_args",
        f"ledger={ledger}",
        "--tasks",
        "fg_cloze",
        "--limit",
        "6",
        "--output_path",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "fg_cloze" in printed and "fallbackgate: ledger run 1: PASS" in printed
    assert json.loads((out / "fallbackgate.json").read_text())["runs"] == [{"run_id": 1, "passed": True, "reasons": []}]
    (results,) = out.rglob("results_*.json")
    config = json.loads(results.read_text())["config"]
    assert config["model"] == "fallbackgate" and config["device"] == "cpu"  # the real device, not cuda:0
    with open_ledger(str(ledger)) as led:
        (run,) = queries.list_runs(led)
        assert run["status"] == "complete" and len(queries.request_summaries(led, run["id"])) > 0


def test_print_include_path_gives_tasks_lm_eval_reads(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FALLBACKGATE_CACHE_DIR", str(tmp_path))
    assert main(["lm-eval", "--print-include-path"]) == 0
    path = pathlib.Path(capsys.readouterr().out.strip())
    names = sorted(p.stem for p in path.glob("*.yaml"))
    assert names == ["fg_cloze", "fg_names", "fg_rolling_ppl"]
    assert all("__FALLBACKGATE_DATA__" not in p.read_text() for p in path.glob("*.yaml"))
    from lm_eval.tasks import TaskManager

    assert {"fg_cloze", "fg_names", "fg_rolling_ppl"} <= set(TaskManager(include_path=str(path)).all_tasks)


def test_import_fallbackgate_registers_the_model_for_simple_evaluate() -> None:
    from lm_eval.api.registry import get_model

    import fallbackgate

    assert fallbackgate.register_lm_eval_model()
    assert get_model("fallbackgate").__name__ == "FallbackgateLM"
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still there
