"""A ledger produced by real engine runs, shared by the dashboard tests (built once per process).

Two ``fallbackgate run`` invocations on a small random Qwen3-MoE checkpoint with two request classes:
run 1 exact (tags resident/exact_load only), run 2 with forced ``kv_dequant`` and ``expert_defer``.
``fallbackgate run`` does not record SLOs or quality budgets yet, so they are set on the request rows
afterwards; then ``fallbackgate gate --record`` judges both runs (run 1 passes, run 2 breaks its
``max_mean_kl``). One fitted calibration scale is recorded through the LedgerWriter.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import tempfile
from pathlib import Path

from fallbackgate import cli
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from tests.checkpoints import make_checkpoint

PROMPTS = (
    {"prompt": "the quick brown fox jumps over", "id": "a", "class": "chat"},
    {"prompt": "once upon a time a princess lived", "id": "b", "class": "batch"},
)
SLO_MET = {"ttft_ms": 1e7, "tpot_ms": 1e7}  # request a: met, measured and modeled
SLO_TIGHT = {"ttft_s": 0.001, "tpot_s": 0.001}  # request b: modeled times meet it, measured ones do not
BUDGET = {"max_mean_kl": 1e-3, "max_p99_kl": 1e-2, "min_top1_agreement": 0.2, "max_approx_fraction": 0.9}
CALIBRATION = ("kv_dequant", 0, 2.5)


def _run(args: list[str]) -> int:
    return cli.main(args)


@functools.cache
def real_ledger() -> Path:
    """Path of the SQLite ledger (built on first call, reused by every later call in this process)."""
    root = Path(tempfile.mkdtemp(prefix="fallbackgate-dash-"))
    ck = make_checkpoint("qwen3_moe", root / "ck", 0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    db = root / "ledger.sqlite"
    common = ["run", "--model", str(ck), "--ledger", str(db), "--prompts", str(prompts), "--quiet"]
    common += ["--device-budget-mb", "0.3", "--max-new-tokens", "10"]
    assert _run(common) == 0
    _run([*common, "--force", "kv_dequant", "--force", "expert_defer"])
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE requests SET slo = ?, budget = ? WHERE request_id = 'a'", (json.dumps(SLO_MET), None))
        con.execute("UPDATE requests SET slo = ? WHERE request_id = 'b'", (json.dumps(SLO_TIGHT),))
        con.execute("UPDATE requests SET budget = ? WHERE run_id = 2", (json.dumps(BUDGET),))
    con.close()
    assert _run(["gate", "--ledger", str(db), "--run", "1", "--record"]) == 0
    assert _run(["gate", "--ledger", str(db), "--run", "2", "--record"]) == 1
    with open_ledger(str(db)) as ledger, LedgerWriter(ledger) as w:
        tag, layer, scale = CALIBRATION
        w.record_calibration(tag, layer, scale, num_samples=7, run_ids=[2])
    return db


def sql(db: Path, query: str, params: tuple = ()) -> list[tuple]:
    """Rows of a plain SQL query on the ledger file (the tests' independent numbers)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(query, params).fetchall()
    finally:
        con.close()


def test_real_ledger_has_both_runs() -> None:
    db = real_ledger()
    assert sql(db, "SELECT id, status FROM runs ORDER BY id") == [(1, "complete"), (2, "complete")]
    approx = sql(db, "SELECT run_id, SUM(count) FROM events WHERE exactness = 'approximate' GROUP BY run_id")
    assert [r[0] for r in approx] == [2] and approx[0][1] > 0
    newest = (
        "SELECT run_id, passed FROM verdicts v WHERE request_id IS NULL AND id = "
        "(SELECT MAX(id) FROM verdicts w WHERE w.run_id = v.run_id AND w.request_id IS NULL) ORDER BY run_id"
    )
    assert sql(db, newest) == [(1, 1), (2, 0)]  # `run` recorded a verdict; `gate --record` added the newest
