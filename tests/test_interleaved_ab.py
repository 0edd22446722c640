"""``python -m fallbackgate.bench.interleaved_ab``: joint variants run after run per seed and workload, the order
rotated by seed; a variant is an admission and a class-budgets file, checked before anything runs; the report is
each variant's paired change against the first, over the seeds every variant ran."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.bench.interleaved_ab import compare, main, parse_variant, report_lines, run_order
from fallbackgate.sweep.intervals import interval

REPO = pathlib.Path(__file__).resolve().parents[1]
OPEN = REPO / "fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"
REFERENCE_SWEEP = REPO / "fallbackgate/sweep_results/seeds50-59/sweep.json"


def test_a_variant_is_an_admission_and_an_optional_budgets_file_each_checked() -> None:
    plain, opened = parse_variant("shipped=exact"), parse_variant(f"colder=lowbit_colder:{OPEN}")
    assert (plain.name, plain.admission, plain.class_budgets) == ("shipped", "exact", None)
    assert opened.admission == "lowbit_colder" and opened.class_budgets["best-effort"]["max_approx_fraction"] == 1.0
    for text, message in (("exact", "NAME=ADMISSION"), ("x=", "NAME=ADMISSION"), ("x=colder", "is not one of"),
                          ("x=exact:/no/such.yaml", "--class-budgets /no/such.yaml")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_variant(text)


def test_each_variant_runs_first_as_often_as_the_others() -> None:
    names = ["a", "b", "c"]
    orders = [run_order(names, i) for i in range(6)]
    assert all(sorted(order) == names for order in orders)
    assert [order[0] for order in orders] == ["a", "b", "c", "a", "b", "c"]


def _row(seed: int, variant: str, ttft: float, slo: float) -> dict:
    return {"seed": seed, "workload": "mixed", "ram_frac": 0.25, "variant": variant,
            "metrics": {"ttft_p50_ms": ttft, "slo_attainment": slo}}  # fmt: skip


def test_changes_are_paired_over_the_seeds_every_variant_ran() -> None:
    # seed 3 lacks b: left out
    rows = [_row(1, "a", 10.0, 0.0), _row(1, "b", 11.0, 0.5), _row(2, "a", 20.0, 0.0), _row(2, "b", 22.0, 0.25),
            _row(3, "a", 99.0, 0.0)]  # fmt: skip
    comparison = compare(rows, ["a", "b"], ("ttft_p50_ms", "slo_attainment"))
    cell = comparison["mixed@0.25"]
    assert cell["seeds"] == [1, 2]
    ttft = cell["metrics"]["ttft_p50_ms"]
    assert ttft["a"] == {"mean": 15.0, "change": None} and ttft["b"]["mean"] == 16.5
    assert ttft["b"]["change"] == interval([1 / 15, 2 / 15]) and ttft["b"]["change"]["mean"] == pytest.approx(0.1)
    assert cell["metrics"]["slo_attainment"]["b"] == {"mean": 0.375, "change": None}  # no base to divide by
    lines = report_lines(comparison, ["a", "b"])
    assert lines[0] == "mixed@0.25 n=2" and "b 16.5 (+10.0 % [" in lines[1] and ", n=2)" in lines[1]
    assert "b 0.375" in lines[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", "a=exact"], "two or more"),
        (["--variant", "a=exact", "--variant", "a=lowbit_colder"], "each named once"),
        (["--variant", "a=exact", "--variant", "b=nope"], "is not one of"),
        (["--variant", "a=exact", "--variant", "b=exact", "--slo-from", str(REFERENCE_SWEEP), "--ram-frac", "0.3"],
         "do not include 0.3"),
        (["--variant", "a=exact", "--variant", "b=exact", "--slo-from", "/no/such.json"], "--slo-from /no/such.json"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_any_run(argv, message, tmp_path, capsys) -> None:
    out = tmp_path / "ab.json"
    base = ["--seeds", "60", "--workloads", "mixed", "--ram-frac", "0.25", "--out", str(out)]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err and not out.exists()


def _fake_runs(monkeypatch, out: pathlib.Path, fail_at: int | None = None) -> list[str]:
    """`run_one` replaced: each call records its variant, sees the JSON as written so far, and the
    `fail_at`-th call raises an error that is no EngineError."""
    import fallbackgate.bench.interleaved_ab as ab

    calls: list[str] = []
    num_done = [0]

    def run_one(base, variant, workload, seed, ledger):
        written = json.loads(out.read_text())["runs"] if out.exists() else []
        assert len(written) == num_done[0]  # the JSON holds every run done before this one
        calls.append(variant.name)
        if len(calls) == fail_at:
            raise RuntimeError("planted: this run fails")
        num_done[0] += 1
        return {"seed": seed, "workload": workload, "ram_frac": 0.25, "variant": variant.name,
                "metrics": {m: float(seed) for m in ab.DEFAULT_METRICS}}  # fmt: skip

    monkeypatch.setattr(ab, "run_one", run_one)
    monkeypatch.setattr(ab, "slo_targets", lambda base, path, ledger: {})
    return calls


AB_ARGV = ["--seeds", "1,2", "--workloads", "mixed", "--ram-frac", "0.25", "--variant", "a=exact",
           "--variant", "b=lowbit_colder"]  # fmt: skip


def test_a_run_that_fails_stays_with_that_run_and_the_json_follows_every_run(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "ab.json"
    calls = _fake_runs(monkeypatch, out, fail_at=3)  # seed 2 runs b first: b fails, a still runs
    assert main([*AB_ARGV, "--out", str(out)]) == 1
    body = json.loads(out.read_text())
    assert calls == ["a", "b", "b", "a"] and [r["variant"] for r in body["runs"]] == ["a", "b", "a"]
    assert body["failed_runs"] == [{"seed": 2, "workload": "mixed", "variant": "b",
                                    "error": "RuntimeError('planted: this run fails')"}]  # fmt: skip
    assert body["is_complete"] and body["error"] is None
    assert body["comparison"]["mixed@0.25"]["seeds"] == [1] and "this run fails" in capsys.readouterr().err


def test_a_metric_the_runs_do_not_record_stops_the_ab_after_its_first_run(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "ab.json"
    calls = _fake_runs(monkeypatch, out)
    assert main([*AB_ARGV, "--out", str(out), "--metrics", "ttft_p50_ms,ttft_p05_ms"]) == 2
    body = json.loads(out.read_text())
    assert calls == ["a"] and len(body["runs"]) == 1 and not body["is_complete"]
    assert "--metrics: the runs record no ttft_p05_ms" in body["error"] and "ttft_p05_ms" in capsys.readouterr().err


def test_one_seed_gives_a_change_without_an_interval() -> None:
    comparison = compare([_row(1, "a", 10.0, 0.5), _row(1, "b", 12.0, 0.5)], ["a", "b"], ("ttft_p50_ms",))
    change = comparison["mixed@0.25"]["metrics"]["ttft_p50_ms"]["b"]["change"]
    assert change["mean"] == pytest.approx(0.2) and (change["lo"], change["hi"], change["n"]) == (None, None, 1)
    assert "b 12 (+20.0 %, n=1: no interval)" in report_lines(comparison, ["a", "b"])[1]


def test_seeds_that_do_not_balance_the_order_are_noted(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "ab.json"
    _fake_runs(monkeypatch, out)
    argv = [*AB_ARGV, "--out", str(out)]
    argv[1] = "1,2,3"
    assert main(argv) == 0
    assert "3 seeds for 2 variants" in capsys.readouterr().err and json.loads(out.read_text())["is_complete"]


@pytest.mark.slow
def test_two_variants_run_after_run_against_one_reference(tmp_path, capsys) -> None:
    out = tmp_path / "ab.json"
    argv = ["--seeds", "0", "--workloads", "multi-turn", "--ram-frac", "0.25", "--out", str(out),
            "--variant", "shipped=exact", "--variant", f"colder=lowbit_colder:{OPEN}"]  # fmt: skip
    assert main(argv) == 0
    body = json.loads(out.read_text())
    runs = body["runs"]
    assert [(r["seed"], r["workload"], r["variant"]) for r in runs] == [(0, "multi-turn", "shipped"),
                                                                       (0, "multi-turn", "colder")]  # fmt: skip
    assert all(r["metrics"]["gate_passed"] == 1.0 for r in runs)
    assert runs[0]["metrics"]["lowbit_uses"] < runs[1]["metrics"]["lowbit_uses"]  # the admission took effect
    assert runs[1]["metrics"]["over_belady_same_room"] < runs[0]["metrics"]["over_belady_same_room"]
    change = body["comparison"]["multi-turn@0.25"]["metrics"]["ttft_p50_ms"]["colder"]["change"]
    assert change["n"] == 1 and change["lo"] is None and change["hi"] is None
    assert "multi-turn@0.25 n=1" in capsys.readouterr().out
