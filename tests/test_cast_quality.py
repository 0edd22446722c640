"""``bench.cast_quality``: a model against itself costs nothing; its bf16 copy (``synth.cast``) costs a little,
measured as KL, top-1 agreement, perplexity and the share of tokens routed to the same experts."""

from __future__ import annotations

import json
import pathlib

import pytest
from transformers import AutoTokenizer

from fallbackgate.bench import cast_quality
from fallbackgate.synth.cast import main as cast_main
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tinymoe.evaluate import DATA_DIR, read_jsonl, routing_windows


def test_the_model_against_itself_and_against_its_bf16_copy(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = [r["text"] for r in read_jsonl(DATA_DIR / "rolling_ppl.jsonl", 4)]
    windows = routing_windows(AutoTokenizer.from_pretrained(CHECKPOINT_DIR), texts, 2, 64)
    same = cast_quality.compare(cast_quality.load(CHECKPOINT_DIR), cast_quality.load(CHECKPOINT_DIR), windows)
    assert same["kl_max"] == pytest.approx(0.0, abs=1e-9) and same["top1_agreement"] == 1.0
    assert same["same_experts_share_per_layer"] == [1.0] * 4  # the four MoE layers
    assert same["perplexity_copy"] == pytest.approx(same["perplexity_original"])
    assert cast_main(["--model", str(CHECKPOINT_DIR), "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    out = tmp_path / "q.json"
    cast_quality.main(["--compressed", str(tmp_path / "bf16"), "--windows", "2", "--seq", "64", "--json", str(out)])
    bf16 = json.loads(out.read_text())
    assert bf16["num_tokens"] == 128 and 0 < bf16["kl_mean"] < 0.05 and bf16["top1_agreement"] > 0.8
    assert all(0.5 < s <= 1.0 for s in bf16["same_experts_share_per_layer"])
    assert "top-1 agreement" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--compressed", "/nonexistent/copy"], "cast_quality: "),
        (["--compressed", str(CHECKPOINT_DIR), "--windows", "0"], "--windows must be >= 1"),
        (["--compressed", str(CHECKPOINT_DIR), "--windows", "100000"], "windows of 256 tokens, not 100000"),
        (["--compressed", str(CHECKPOINT_DIR), "--data", "/nonexistent"], "rolling_ppl.jsonl"),
    ],
)
def test_bad_input_is_refused_with_a_message(argv: list[str], needle: str) -> None:
    with pytest.raises(SystemExit, match=needle):
        cast_quality.main(argv)
