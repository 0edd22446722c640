"""Bad checkpoints, `fallbackgate verify` and `python -m fallbackgate.synth`: exit 2 with a message that
names the file and tensor, never a traceback; synth writes published shapes shard by shard."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from fallbackgate import cli
from fallbackgate.engine.experts.manifest import MANIFEST_FILE
from fallbackgate.engine.model.checkpoint_files import INDEX_FILE
from fallbackgate.synth import __main__ as synth
from fallbackgate.synth.shapes import PUBLISHED
from fallbackgate.synth.writer import build_config, planned_tensors, total_bytes, write_checkpoint
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.checkpoints import make_checkpoint


@pytest.fixture()
def ckpt(tmp_path: pathlib.Path, checkpoint_factory) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(checkpoint_factory("qwen3_moe"), tmp_path / "ckpt"))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _run_model(capsys, path: pathlib.Path) -> tuple[int, str]:
    return _run(capsys, "run", "--model", str(path), "--no-ledger", "--quiet", "--max-new-tokens", "2")


def test_truncated_shard(ckpt: pathlib.Path, capsys) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, text = _run_model(capsys, ckpt)
    assert code == 2 and "model.safetensors: not a readable safetensors file" in text and "Traceback" not in text


def _shard_with_index(ckpt: pathlib.Path) -> dict:
    names = list(json.loads((ckpt / MANIFEST_FILE).read_text())["experts"])  # any file works: read its header
    assert names
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    return index


def test_missing_index_entry_names_the_tensor(ckpt: pathlib.Path, capsys) -> None:
    index = _shard_with_index(ckpt)
    dropped = "model.layers.1.mlp.experts.3.up_proj.weight"
    del index["weight_map"][dropped]
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    code, text = _run_model(capsys, ckpt)
    assert code == 2 and f"tensor {dropped} (in model.safetensors) has no index entry" in text


def test_index_naming_a_missing_shard(ckpt: pathlib.Path, capsys) -> None:
    index = _shard_with_index(ckpt)
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    code, text = _run_model(capsys, ckpt)
    assert code == 2 and "lists shard model-00002-of-00002.safetensors, which does not exist" in text


def test_expert_missing_a_matrix_is_an_unsupported_layout(ckpt: pathlib.Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    code, text = _run_model(capsys, ckpt)
    assert code == 2 and "expert (2, 5) lacks tensor(s) ['down_proj']" in text


def test_without_a_manifest_the_error_says_how_to_make_one(ckpt: pathlib.Path, capsys) -> None:
    (ckpt / MANIFEST_FILE).unlink()
    code, text = _run_model(capsys, ckpt)
    assert code == 2 and f"fallbackgate verify --model {ckpt}" in text
    code, text = _run(capsys, "verify", "--model", str(ckpt), "--quiet")
    assert code == 0 and "24 experts mapped and hashed" in text
    assert _run_model(capsys, ckpt)[0] == 0


def test_verify_check_finds_a_changed_expert(ckpt: pathlib.Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    assert _run(capsys, "verify", "--model", str(ckpt), "--check", "--quiet")[0] == 0
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.1.up_proj.weight"][0, 0] += 1
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    code, text = _run(capsys, "verify", "--model", str(ckpt), "--check", "--quiet")
    assert code == 1 and "expert (0, 1): model.layers.0.mlp.experts.1.gate_proj.weight" in text
    assert "23 of 24 experts match" in text
    assert _run(capsys, "verify", "--model", str(ckpt / "nope"))[0] == 2


def test_synth_shapes_are_the_published_ones() -> None:
    counts = {}
    for name, (model_type, fields) in PUBLISHED.items():
        dense, experts = planned_tensors(build_config(model_type, fields, None, None))
        num = sum(torch.Size(s).numel() for _, s in dense)
        num += sum(e * two_i * h * 3 // 2 for e, two_i, h in experts.values())
        counts[name] = round(num / 1e9, 2)
    assert counts == {
        "olmoe-1b-7b": 6.92,
        "qwen3-30b-a3b": 30.53,
        "mixtral-8x7b": 46.7,
        "deepseek-v3": 671.03,
        "deepseek-v2-lite": 15.71,
    }


def test_synth_writes_shards_an_index_and_a_manifest_that_transformers_and_the_engine_read(
    tmp_path: pathlib.Path,
) -> None:
    from fallbackgate.controllers.exact_lru import ExactLRUController
    from fallbackgate.engine.config import EngineConfig
    from fallbackgate.engine.engine import Engine

    fields = dict(
        PUBLISHED["mixtral-8x7b"][1], hidden_size=64, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
    )
    bundled = json.loads((CHECKPOINT_DIR / "config.json").read_text())
    config = build_config("mixtral", fields, 2, bundled)
    out = tmp_path / "mixtral-small"
    written = write_checkpoint(config, out, torch.bfloat16, CHECKPOINT_DIR, shard_bytes=200_000)
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 3 and written == total_bytes(config, torch.bfloat16)
    assert "model.layers.1.mlp.experts.7.w2.weight" in index
    engine = Engine(EngineConfig(model_dir=str(out)), ExactLRUController())  # manifest checked on every read
    assert engine.dtype == torch.bfloat16 and len(engine.expert_store.entries) == 16
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 96, 64)


def test_synth_bad_input_exits_2(tmp_path: pathlib.Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    assert synth.main(["--like", "gpt-5", "--out", str(tmp_path / "x")]) == 2
    assert "--like 'gpt-5': unknown; choose one of olmoe-1b-7b" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert synth.main(["--like", "olmoe-1b-7b", "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(100e9, 50e9, 50e9))
    assert synth.main(["--like", "mixtral-8x7b", "--out", str(tmp_path / "big")]) == 2  # full depth in bf16
    assert "needs 92.9 GB, only 50.0 GB free" in capsys.readouterr().err
    assert not (tmp_path / "big").exists() or not any((tmp_path / "big").iterdir())


def test_bf16_checkpoint_reports_its_dtype_in_the_cli(tmp_path: pathlib.Path, capsys) -> None:
    path = make_checkpoint("olmoe", tmp_path / "olmoe-bf16", dtype=torch.bfloat16)
    code, text = _run(
        capsys,
        "run",
        "--model",
        str(path),
        "--no-ledger",
        "--quiet",
        "--max-new-tokens",
        "2",
        "--json",
        str(tmp_path / "out.json"),
    )
    assert code == 0
    memory = json.loads((tmp_path / "out.json").read_text())["memory"]
    assert memory["dtype"] == "bfloat16" and memory["peak_device_pool_bytes"] <= memory["device_budget_bytes"]


def _cut(file: pathlib.Path) -> None:
    file.write_bytes(file.read_bytes()[:53])  # JSON cut off mid-way


def _index_not_a_map(ckpt: pathlib.Path) -> None:
    _shard_with_index(ckpt)
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": ["model.safetensors"]}))


def _index_cut(ckpt: pathlib.Path) -> None:
    _shard_with_index(ckpt)
    _cut(ckpt / INDEX_FILE)


def _bad_header(ckpt: pathlib.Path) -> None:
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:40] = b"#" * 32  # the JSON header's first bytes
    shard.write_bytes(bytes(data))


CORRUPTIONS = {
    "config cut": ("config.json", lambda c: _cut(c / "config.json"), "is not valid JSON"),
    "config not an object": (
        "config.json",
        lambda c: (c / "config.json").write_text("[1, 2]"),
        "expected a JSON object",
    ),
    "config bad value": (
        "config.json",
        lambda c: (c / "config.json").write_text(
            json.dumps(json.loads((c / "config.json").read_text()) | {"num_attention_heads": "many"})
        ),
        "transformers could not build the model from it",
    ),
    "tokenizer cut": ("tokenizer.json", lambda c: _cut(c / "tokenizer.json"), "is not valid JSON"),
    "tokenizer wrong shape": (
        "tokenizer.json",
        lambda c: (c / "tokenizer.json").write_text('{"model": 3}'),
        "transformers could not load the tokenizer",
    ),
    "tokenizer config cut": ("tokenizer_config.json", lambda c: _cut(c / "tokenizer_config.json"), "is not valid JSON"),
    "index cut": (INDEX_FILE, _index_cut, "not a safetensors index"),
    "index not a map": (INDEX_FILE, _index_not_a_map, "'weight_map' must map tensor names to shard file names"),
    "shard header": ("model.safetensors", _bad_header, "not a readable safetensors file"),
    "manifest cut": (MANIFEST_FILE, lambda c: _cut(c / MANIFEST_FILE), "not a fallbackgate manifest"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_file_is_named_on_one_line(kind: str, tmp_path: pathlib.Path, capsys) -> None:
    bundled = pathlib.Path(shutil.copytree(CHECKPOINT_DIR, tmp_path / "bundled"))
    name, corrupt, what = CORRUPTIONS[kind]
    corrupt(bundled)
    code = cli.main(["run", "--model", str(bundled), "--no-ledger", "--quiet", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("fallbackgate run: error: "), err
    assert str(bundled / name) in lines[0] and what in lines[0], lines[0]
