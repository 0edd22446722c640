"""``python -m fallbackgate.synth.cast``: a copy of a checkpoint in another dtype — every float tensor rounded as
``Tensor.to`` rounds it, integers untouched, config and manifest matching the new bytes — and clear refusals."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from fallbackgate.commands.verify import _check as check_manifest
from fallbackgate.engine.model.checkpoint_files import INDEX_FILE
from fallbackgate.synth.cast import cast_checkpoint, cast_tensors, main
from fallbackgate.tinymoe import CHECKPOINT_DIR


def test_float_tensors_are_rounded_and_others_kept() -> None:
    tensors = {"w": torch.tensor([1.0 + 2**-10, 3.0]), "ids": torch.tensor([1, 2]), "mask": torch.tensor([True])}
    cast = cast_tensors(tensors, torch.bfloat16)
    assert cast["w"].dtype == torch.bfloat16 and cast["w"].tolist() == [1.0, 3.0]  # 1 + 2^-10 rounds to 1 in bf16
    assert cast["ids"].dtype == torch.int64 and cast["mask"].dtype == torch.bool


def test_the_bundled_model_in_bf16_has_half_the_bytes_and_a_matching_manifest(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bf16"
    assert main(["--model", str(CHECKPOINT_DIR), "--dtype", "bf16", "--out", str(out)]) == 0
    src, dst = load_file(CHECKPOINT_DIR / "model.safetensors"), load_file(out / "model.safetensors")
    assert src.keys() == dst.keys()
    for name, tensor in src.items():
        assert dst[name].dtype == torch.bfloat16 and torch.equal(dst[name], tensor.to(torch.bfloat16)), name
    sizes = [(d / "model.safetensors").stat().st_size for d in (CHECKPOINT_DIR, out)]
    assert sizes[1] / sizes[0] == pytest.approx(0.5, abs=0.01)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (CHECKPOINT_DIR / "tokenizer.json").read_bytes()
    assert check_manifest(out, True) == 0  # every expert's new bytes hashed
    manifests = [json.loads((d / "fallbackgate-manifest.json").read_text()) for d in (CHECKPOINT_DIR, out)]
    assert manifests[0] != manifests[1]


def test_a_non_empty_out_a_quantized_or_missing_checkpoint_is_refused(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["--model", str(CHECKPOINT_DIR), "--dtype", "bf16", "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["--model", str(CHECKPOINT_DIR), "--dtype", "int4", "--out", str(tmp_path / "o")]) == 2
    assert "choose bf16, fp16 or fp32" in capsys.readouterr().err
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    save_file({"w": torch.zeros(2)}, fp8 / "model.safetensors")
    assert main(["--model", str(fp8), "--dtype", "bf16", "--out", str(tmp_path / "o2")]) == 2
    assert "quantized (fp8)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no readable config.json"):
        cast_checkpoint(tmp_path / "nothing", tmp_path / "o3", torch.bfloat16)


def test_a_sharded_checkpoint_keeps_its_index_and_sub_configs_name_the_dtype(tmp_path: pathlib.Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    expert = "model.layers.0.mlp.experts.0."
    gate, up, down = (expert + f"{n}_proj.weight" for n in ("gate", "up", "down"))
    save_file({gate: torch.ones(2, 2), up: torch.ones(2, 2), "ids": torch.arange(3)},
              src / "model-00001-of-00002.safetensors")  # fmt: skip
    save_file({down: torch.full((2, 2), 2.5)}, src / "model-00002-of-00002.safetensors")
    save_file({"stray": torch.ones(8)}, src / "consolidated.safetensors")  # not in the index: not weights
    weight_map = {gate: "model-00001-of-00002.safetensors", up: "model-00001-of-00002.safetensors",
                  "ids": "model-00001-of-00002.safetensors", down: "model-00002-of-00002.safetensors"}  # fmt: skip
    (src / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 72}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32", "text_config": {"dtype": "float32"}}))
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("kept")
    assert cast_checkpoint(src, out, torch.float16) == 3 * 4 * 2 + 3 * 8  # three 2x2 in fp16, ids int64
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["weight_map"] == weight_map and index["metadata"]["total_size"] == 48
    config = json.loads((out / "config.json").read_text())
    assert config == {"torch_dtype": "float16", "dtype": "float16", "text_config": {"dtype": "float16"}}
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(set(weight_map.values()))
    assert load_file(out / "model-00002-of-00002.safetensors")[down].dtype == torch.float16
    assert check_manifest(out, True) == 0
    assert (out / "extra" / "notes.txt").read_text() == "kept"


def test_values_fp16_cannot_hold_or_float8_codes_are_refused_and_nothing_is_left(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="beyond torch.float16's range"):
        cast_tensors({"w": torch.tensor([1e6])}, torch.float16)
    assert cast_tensors({"w": torch.tensor([float("inf")])}, torch.float16)["w"].isinf().all()  # inf stays inf
    with pytest.raises(ValueError, match="float8_e4m3fn is not cast"):
        cast_tensors({"w": torch.zeros(2, dtype=torch.float8_e4m3fn)}, torch.bfloat16)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"w": torch.tensor([1e6])}, src / "model.safetensors")
    assert main(["--model", str(src), "--dtype", "fp16", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
