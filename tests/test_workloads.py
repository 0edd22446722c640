"""``fallbackgate workload``: the probe's workloads as prompts files with arrival times.

Lengths are checked in the bundled model's own tokens (counted here with its tokenizer, independently of the
generator) as fractions of the length limit; files are checked through the prompts-file loader the engine's
commands use.
"""

from __future__ import annotations

import collections
import itertools
import json
import pathlib

import pytest
from transformers import AutoTokenizer

from fallbackgate.batch.prompts import PromptsFileError, load_prompts
from fallbackgate.cli import main
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.workloads.arrivals import TurnTiming
from fallbackgate.workloads.build import generate, prompt_specs, to_jsonl
from fallbackgate.workloads.kinds import Context, WorkloadKind, registered_kinds
from fallbackgate.workloads.mixed import PHASE_KINDS
from fallbackgate.workloads.text import TextPool, find_corpus
from fallbackgate.workloads.tokens import ModelTokens, length_limit

LIMIT = 1024  # the bundled model: min(max_model_len 2048, max_position_embeddings 1024)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(CHECKPOINT_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def model_tokens() -> ModelTokens:
    return ModelTokens(CHECKPOINT_DIR)


def _context(model_tokens: ModelTokens, limit: int = LIMIT, num_phases: int = 4) -> Context:
    return Context(model_tokens, TextPool.load(model_tokens, None), limit, num_phases=num_phases)


def _write(tmp_path: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    out = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}.jsonl"
    assert main(["workload", name, "--out", str(out), "--no-corpus", *extra]) == 0
    return out


def test_the_limit_is_the_engines() -> None:
    assert length_limit(CHECKPOINT_DIR).tokens == LIMIT
    assert length_limit(CHECKPOINT_DIR, 512).tokens == 512
    assert length_limit(CHECKPOINT_DIR, 4096).tokens == LIMIT  # capped by the model's positions
    assert set(registered_kinds()) == set(WorkloadKind)


@pytest.mark.parametrize("limit", [LIMIT, 255])
def test_each_kinds_lengths_are_fractions_of_the_limit(model_tokens, tokenizer, limit: int) -> None:
    ctx = _context(model_tokens, limit)
    for kind in WorkloadKind:
        for r in generate(ctx, kind, 3, 24, None).requests:
            prompt, answer = len(tokenizer.encode(r.prompt)), r.max_new_tokens
            assert prompt == r.prompt_tokens and prompt + answer <= limit, (kind, prompt, answer)
            frame = 16  # tokens of the shortest prompts' frame ("User: ...\nAssistant:")
            if r.kind is WorkloadKind.SHORT_CHAT:
                assert prompt <= max(0.08 * limit, frame) + 1 and 0.02 * limit - 1 <= answer <= 0.12 * limit + 1
            elif r.kind is WorkloadKind.LONG_RETRIEVAL:
                assert answer <= 0.04 * limit + 1 and prompt >= 0.8 * (limit - answer), (prompt, answer)
            elif r.kind is WorkloadKind.LONG_REASONING:
                assert prompt <= max(0.05 * limit, frame) + 1 and 0.25 * limit - 1 <= answer <= limit // 2
            else:
                assert r.kind is WorkloadKind.MULTI_TURN and 0.02 * limit - 1 <= answer <= 0.06 * limit + 1


def test_long_kinds_reach_their_lengths(model_tokens) -> None:
    ctx = _context(model_tokens)
    retrieval = generate(ctx, WorkloadKind.LONG_RETRIEVAL, 0, 16, None).requests
    assert max(r.prompt_tokens + r.max_new_tokens for r in retrieval) >= 0.95 * LIMIT
    reasoning = generate(ctx, WorkloadKind.LONG_REASONING, 0, 16, None).requests
    assert max(r.max_new_tokens for r in reasoning) >= 0.45 * LIMIT
    turns = generate(ctx, WorkloadKind.MULTI_TURN, 0, 32, None).requests
    assert max(r.prompt_tokens for r in turns) >= 0.5 * LIMIT  # sessions grow toward the limit


def test_multi_turn_prompts_extend_the_previous_turn_token_for_token(model_tokens, tokenizer) -> None:
    ctx = _context(model_tokens)
    requests = generate(ctx, WorkloadKind.MULTI_TURN, 5, 40, None).requests
    sessions = collections.defaultdict(list)
    for r in requests:
        sessions[r.session].append(r)
    assert len(sessions) >= 3 and max(len(turns) for turns in sessions.values()) >= 3
    timing = TurnTiming()
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for before, after in zip(turns, turns[1:], strict=False):
            previous, ids = tokenizer.encode(before.prompt), tokenizer.encode(after.prompt)
            assert after.prompt.startswith(before.prompt) and len(ids) > len(previous)
            assert ids[: len(previous)] == previous
            expected_finish = before.arrival_s + timing.expected_service_s(before.prompt_tokens, before.max_new_tokens)
            assert after.arrival_s >= expected_finish - 1e-6


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: pathlib.Path) -> None:
    for name in ("short-chat", "multi-turn", "mixed"):
        first, again = _write(tmp_path, name, "--seed", "7"), _write(tmp_path, name, "--seed", "7")
        other = _write(tmp_path, name, "--seed", "8")
        assert first.read_bytes() == again.read_bytes()
        assert first.read_bytes() != other.read_bytes()


@pytest.mark.parametrize("name", [k.value for k in WorkloadKind])
def test_files_load_as_prompts_with_sorted_arrivals(tmp_path: pathlib.Path, name: str) -> None:
    out = _write(tmp_path, name, "--num-requests", "12", "--class", "strict")
    specs = load_prompts(out)
    assert len(specs) == 12 and all(s.request_class == "strict" and s.max_new_tokens for s in specs)
    arrivals = [s.arrival_s for s in specs]
    assert all(a is not None and a >= 0 for a in arrivals) and arrivals == sorted(arrivals)
    turns = [s for s in specs if s.session is not None]
    assert all(s.turn is not None and s.request_id == f"{s.session}-t{s.turn}" for s in turns)
    assert bool(turns) == (name in ("multi-turn", "mixed"))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["prompt"] for line in lines] == [s.prompt for s in specs]


def test_mixed_changes_phase(model_tokens) -> None:
    ctx = _context(model_tokens, num_phases=8)
    workload = generate(ctx, WorkloadKind.MIXED, 2, 40, None)
    phases = [(kind, len(list(run))) for kind, run in itertools.groupby(workload.requests, key=lambda r: r.kind)]
    assert [size for _, size in phases] == [5] * 8  # bursts do not overlap: each phase is one run of its kind
    kinds = [kind for kind, _ in phases]
    assert all(a is not b for a, b in zip(kinds, kinds[1:], strict=False)) and set(kinds) == set(PHASE_KINDS)
    sessions = collections.defaultdict(set)
    for spec in prompt_specs(workload):
        if spec.session is not None:
            sessions[spec.session].add(spec.turn)
    assert sessions and all(turns == set(range(len(turns))) for turns in sessions.values())  # no shared session


def test_text_sources_bundled_and_corpus(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    books = tmp_path / "books"
    books.mkdir()
    (books / "a_book.txt").write_text("The quick brown fox jumped over the lazy dog again and again. " * 400)
    out = tmp_path / "w.jsonl"
    assert main(["workload", "long-retrieval", "--out", str(out), "--num-requests", "4", "--corpus", str(books)]) == 0
    printed = capsys.readouterr().out
    assert "bundled: 900 passages" in printed and f"corpus: 1 books in {books}" in printed
    assert "quick brown fox" in out.read_text()
    assert main(["workload", "short-chat", "--out", str(out), "--no-corpus", "--max-model-len", "512"]) == 0
    printed = capsys.readouterr().out
    assert "corpus:" not in printed and "model limit: 512 tokens" in printed
    assert "prompt tokens: min" in printed and "output tokens: min" in printed
    if find_corpus() is not None:  # a source checkout beside the shared corpus finds it by itself
        assert main(["workload", "short-chat", "--out", str(out), "--num-requests", "2"]) == 0
        assert "corpus: " in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--num-requests", "0"], "--num-requests"),
        (["--rate", "0"], "--rate"),
        (["--rate", "nan"], "--rate"),
        (["--phases", "1"], "--phases"),
        (["--max-model-len", "64"], "--max-model-len"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--class", ""], "--class"),
        (["--out", "/nonexistent/dir/w.jsonl"], "--out"),
        (["--corpus", "EMPTY"], "--corpus"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(tmp_path, capsys, extra: list[str], flag: str) -> None:
    extra = [str(tmp_path) if item == "EMPTY" else item for item in extra]
    out = ["--out", str(tmp_path / "w.jsonl")] if "--out" not in extra else []
    assert main(["workload", "short-chat", *out, *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fallbackgate workload: error: ") and flag in lines[0]
    assert not (tmp_path / "w.jsonl").exists()


def test_unknown_kind_is_a_usage_error(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["workload", "long-chat", "--out", str(tmp_path / "w.jsonl")])
    assert exit_info.value.code == 2 and "short-chat" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"arrival_s": -1}, "field 'arrival_s' must be a finite number of seconds >= 0"),
        ({"arrival_s": "soon"}, "field 'arrival_s'"),
        ({"arrival_s": True}, "field 'arrival_s'"),
        ({"session": "s1"}, "fields 'session' and 'turn' go together, got only 'session'"),
        ({"turn": 0}, "got only 'turn'"),
        ({"session": "s1", "turn": -1}, "field 'turn' must be an integer >= 0"),
        ({"session": 3, "turn": 0}, "field 'session' must be a string"),
    ],
)
def test_prompts_file_timing_fields_are_checked(tmp_path: pathlib.Path, fields: dict, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "arrival_s": 0.5}) + "\n" + json.dumps({"prompt": "x", **fields}))
    with pytest.raises(PromptsFileError, match=f"^{path}:2: ") as error:
        load_prompts(path)
    assert message in str(error.value)
    path.write_text('{"prompt": "x", "arrival_s": Infinity}\n')
    with pytest.raises(PromptsFileError, match="arrival_s"):
        load_prompts(path)


def test_the_written_file_round_trips(model_tokens, tmp_path: pathlib.Path) -> None:
    specs = prompt_specs(generate(_context(model_tokens), WorkloadKind.MULTI_TURN, 1, 6, None))
    path = tmp_path / "w.jsonl"
    path.write_text(to_jsonl(specs), encoding="utf-8")
    assert load_prompts(path) == specs


def test_corpus_from_the_environment(tmp_path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FALLBACKGATE_CORPUS", str(tmp_path))  # no books there
    assert main(["workload", "short-chat", "--out", str(tmp_path / "w.jsonl")]) == 2
    assert "$FALLBACKGATE_CORPUS" in capsys.readouterr().err
    (tmp_path / "b.txt").write_text("A small book of plain words, told once. " * 50)
    assert main(["workload", "short-chat", "--out", str(tmp_path / "w.jsonl"), "--num-requests", "2"]) == 0
    assert f"corpus: 1 books in {tmp_path}" in capsys.readouterr().out
