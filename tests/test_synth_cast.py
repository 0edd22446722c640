"""``python -m fallbackgate.synth.cast``: a copy of a checkpoint in another dtype — every float tensor rounded as
``Tensor.to`` rounds it, integers untouched, config and manifest matching the new bytes — and clear refusals."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from fallbackgate.commands.verify import _check as check_manifest
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
