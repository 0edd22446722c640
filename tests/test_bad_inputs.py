"""Bad input gets exit 2, a message naming the file, flag or field and the value, no traceback, and nothing
written: a table of cases run in-process through the CLI (each checks that no run row was written)."""

from __future__ import annotations

import pathlib
import sqlite3

import pytest

from fallbackgate.cli import main

# (argv after the command's own name, needle the message must contain); {d} is a scratch directory
RUN_CASES = [
    (["--max-new-tokens", "0"], "--max-new-tokens must be 1.."),
    (["--max-new-tokens", "-3"], "got -3"),
    (["--max-new-tokens", "2000000"], "got 2000000"),
    (["--temperature", "-1"], "--temperature must be a number in [0, 100], got -1.0"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "101"], "got 101.0"),
    (["--seed", "-1"], "--seed must be 0..2^63-1, got -1"),
    (["--seed", str(2**64)], "--seed"),
    (["--device-budget-mb", "inf"], "--device-budget-mb must be a finite number >= 0, got inf"),
    (["--device-budget-mb", "nan"], "--device-budget-mb"),
    (["--device-budget-mb", "-1"], "got -1.0"),
    (["--host-budget-mb", "inf"], "--host-budget-mb"),
    (["--host-budget-mb", "-5"], "--host-budget-mb"),
    (["--audit-rate", "nan"], "--audit-rate"),
    (["--audit-rate", "-0.1"], "--audit-rate"),
    (["--audit-rate", "1.5"], "--audit-rate"),
    (["--block-size", "0"], "--block-size must be 1..65536, got 0"),
    (["--block-size", "3"], "block_size must be a power of two"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--json", "{d}/missing/out.json"], "directory {d}/missing does not exist"),
    (["--json", "{d}"], "is a directory"),
    (["--prompts", "{d}"], "is a directory, not a JSONL file"),
    (["--prompts", "{d}/nope.jsonl"], "prompts file {d}/nope.jsonl does not exist"),
    (["--prompts", "{d}/latin1.jsonl"], "latin1.jsonl:2: not UTF-8 text (byte 0xff)"),
    (["--prompts", "{d}/notjson.jsonl"], "notjson.jsonl:1: not valid JSON"),
    (["--prompts", "{d}/empty.jsonl"], "no prompts"),
    (["--prompts", "{d}/noprompt.jsonl"], "noprompt.jsonl:1"),
    (["--policy", "{d}"], "is a directory, not a policy file"),
    (["--policy", "{d}/nope.yaml"], "does not exist"),
    (["--policy", "{d}/binary.yaml"], "binary.yaml"),
    (["--policy", "{d}/inf.yaml"], "memory.device_budget_mb: got inf"),
    (["--policy", "{d}/nan.yaml"], "memory.device_budget_mb: got nan"),
    (["--policy", "{d}/unknown.yaml"], "frobnicate"),
    (["--ledger", "{d}/foreign.sqlite"], "is not a fallbackgate ledger: it holds other tables (foo)"),
    (["--ledger", "{d}"], "is a directory"),
    (["--ledger", "{d}/text.sqlite"], "is not a SQLite database"),
    (["--ledger", "{d}/missing/l.sqlite"], "does not exist"),
    (["--model", "{d}/nope"], "{d}/nope"),
    (["--model", "{d}/text.sqlite"], "is a file, not a checkpoint directory"),
    (["--max-new-tokens", "5000"], "exceeds the model length limit"),
    (["--prompts", "{d}/long.jsonl"], "exceeds the model length limit"),
    (["--prompts", "{d}/longid.jsonl"], "field 'id' must be 1..128 characters, got 129"),
    (["--prompts", "{d}/longclass.jsonl"], "field 'class' must be a string of 1..64 characters"),
]
OTHER_CASES = [
    (["policy", "check", "{d}/binary.yaml"], "binary.yaml"),
    (["policy", "check", "{d}"], "is a directory"),
    (["policy", "schema", "--output", "{d}/missing/s.json"], "--output {d}/missing/s.json: directory"),
    (["calibrate", "--ledger", "{d}/typo.sqlite"], "no ledger at {d}/typo.sqlite"),
    (["gate", "--ledger", "{d}/typo.sqlite"], "typo.sqlite"),
    (["gate", "--ledger", "{d}/foreign.sqlite"], "not a fallbackgate ledger"),
    (["audit", "--workers", "0", "--ledger", "{d}/l.sqlite"], "--workers must be 1.."),
    (["audit", "--lease-s", "0", "--ledger", "{d}/l.sqlite"], "--lease-s"),
    (["audit", "--follow", "--ledger", "{d}/l.sqlite"], "--follow needs --run"),
    (["audit", "--nice", "40", "--ledger", "{d}/l.sqlite"], "--nice must be 0..19"),
    (["serve", "--port", "0"], "--port must be 1..65535, got 0"),
    (["serve", "--audit-rate", "2"], "--audit-rate"),
    (["serve", "--grace-s", "-1"], "--grace-s"),
    (["serve", "--policy", "{d}/binary.yaml"], "binary.yaml"),
    (["plan", "--context", "0", "--concurrency", "1"], "--context must be >= 1, got 0"),
    (["plan", "--context", "8", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["plan", "--context", "8", "--concurrency", "1", "--device-budget-mb", "inf"], "--device-budget-mb"),
    (["plan", "--context", "8", "--concurrency", "1", "--prompt-tokens", "9"], "--prompt-tokens must be 1..--context"),
    (["plan", "--context", "8", "--concurrency", "1", "--model", "{d}"], "no config.json"),
]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xff"}\n')
    (d / "notjson.jsonl").write_text("{prompt: nope}\n")
    (d / "empty.jsonl").write_text("\n\n")
    (d / "noprompt.jsonl").write_text('{"id": "x"}\n')
    (d / "long.jsonl").write_text('{"prompt": "' + "word " * 3000 + '"}\n')
    (d / "longid.jsonl").write_text('{"prompt": "hi", "id": "' + "x" * 129 + '"}\n')
    (d / "longclass.jsonl").write_text('{"prompt": "hi", "class": "' + "c" * 65 + '"}\n')
    (d / "binary.yaml").write_bytes(bytes(range(256)))
    (d / "inf.yaml").write_text("version: 1\nmemory: {device_budget_mb: .inf}\n")
    (d / "nan.yaml").write_text("version: 1\nmemory: {device_budget_mb: .nan}\n")
    (d / "unknown.yaml").write_text("version: 1\nfrobnicate: 1\n")
    (d / "text.sqlite").write_text("not a database\n")
    con = sqlite3.connect(d / "foreign.sqlite")
    con.execute("CREATE TABLE foo (x)")
    con.commit()
    con.close()
    return d


def _check(argv: list[str], needle: str, d: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    fill = [a.replace("{d}", str(d)) for a in argv]
    foreign = (d / "foreign.sqlite").read_bytes()
    assert main(fill) == 2, fill
    err = capsys.readouterr().err
    assert needle.replace("{d}", str(d)) in err, err
    assert "Traceback" not in err
    assert (d / "foreign.sqlite").read_bytes() == foreign  # an unrelated database is never written


@pytest.mark.parametrize(("argv", "needle"), RUN_CASES, ids=[" ".join(a) for a, _ in RUN_CASES])
def test_run_refuses_bad_input_before_writing(
    argv: list[str], needle: str, scratch: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = scratch / "l.sqlite"
    has_ledger = "--ledger" in argv
    _check(["run", "--quiet", *([] if has_ledger else ["--ledger", str(ledger)]), *argv], needle, scratch, capsys)
    assert not ledger.exists()  # refused before the ledger is even opened: nothing written


@pytest.mark.parametrize(("argv", "needle"), OTHER_CASES, ids=[" ".join(a) for a, _ in OTHER_CASES])
def test_other_commands_refuse_bad_input(
    argv: list[str], needle: str, scratch: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _check(argv, needle, scratch, capsys)
    assert not (scratch / "typo.sqlite").exists()


def test_enough_cases() -> None:
    assert len(RUN_CASES) + len(OTHER_CASES) >= 60


def test_passwords_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    from streamlit.testing.v1 import AppTest

    from fallbackgate.ledger.db import display_url
    from tests.test_dashboard import APP

    url = "postgresql+psycopg://fg:s3cret-pw@127.0.0.1:1/ledger"  # nothing listens on port 1
    assert display_url(url) == "postgresql+psycopg://fg:***@127.0.0.1:1/ledger"
    assert "s3cret" not in display_url("postgresql://fg:s3cret-pw@host/db?x=[")  # unparsable: still hidden
    monkeypatch.setenv("FALLBACKGATE_LEDGER", url)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    shown = " ".join(str(e.value) for e in [*at.error, *at.caption, *at.markdown, *at.info])
    assert "Cannot open the ledger" in shown and "s3cret" not in shown, shown


def _run_forcing_disk_spills(tmp_path: pathlib.Path, ledger: pathlib.Path) -> list[str]:
    return [
        "run",
        "--quiet",
        "--spill-dir",
        str(tmp_path / "spill"),
        "--device-budget-mb",
        "3",
        "--force",
        "kv_dequant",
        "--max-new-tokens",
        "64",
        "--ledger",
        str(ledger),
    ]


def test_full_spill_disk_fails_the_run_cleanly(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    from fallbackgate.engine.kv import spill

    (tmp_path / "spill").mkdir()

    def full(fd: int, buffers: list[memoryview], offset: int) -> int:  # the I/O scheduler's writes (every one a
        raise OSError(errno.ENOSPC, "No space left on device")  # spill segment's here): the disk is full

    monkeypatch.setattr(spill.os, "pwritev", full)
    ledger = tmp_path / "l.sqlite"
    assert main(_run_forcing_disk_spills(tmp_path, ledger)) == 2
    err = capsys.readouterr().err
    assert f"spill directory {tmp_path / 'spill'}: cannot write" in err and "No space left" in err
    assert "Traceback" not in err
    with sqlite3.connect(ledger) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("failed",)]
    assert list((tmp_path / "spill").iterdir()) == []  # the spill directory went with the engine


def test_ledger_write_failure_marks_the_run_failed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqlalchemy.exc import OperationalError

    from fallbackgate.ledger import writer_thread

    insert_rows, calls = writer_thread.insert_rows, []

    def disk_full_once(conn, table, rows, columns) -> None:
        calls.append(table.name)
        if table.name == "events" and calls.count("events") == 2:
            raise OperationalError("INSERT", {}, Exception("database or disk is full"))
        insert_rows(conn, table, rows, columns)

    monkeypatch.setattr(writer_thread, "insert_rows", disk_full_once)
    ledger = tmp_path / "l.sqlite"
    assert main(["run", "--quiet", "--max-new-tokens", "64", "--ledger", str(ledger)]) == 1
    err = capsys.readouterr().err
    assert "ledger writer failed" in err and "disk is full" in err and "Traceback" not in err
    with sqlite3.connect(ledger) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("failed",)]  # marked where the db allows
