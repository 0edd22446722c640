"""Load a transformers MoE causal LM from a local directory without materialising its routed experts."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles
from fallbackgate.engine.model.dense_loader import load_dense_weights

# model_type -> architecture family; each routes its experts through transformers' experts interface.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen2-MoE (shared expert)",
    "mixtral": "Mixtral",
    "olmoe": "OLMoE",
    "deepseek_v3": "DeepSeek-V3 (shared experts, grouped top-k)",
    "glm4_moe": "GLM-4-MoE",
    "ernie4_5_moe": "ERNIE-4.5-MoE",
    "hunyuan_v1_moe": "Hunyuan-MoE",
    "phimoe": "PhiMoE",
    "deepseek_v2": "DeepSeek-V2 (MLA attention, shared experts)",
}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclasses.dataclass(slots=True)
class LoadedCheckpoint:
    """A model skeleton ready for the engine: dense weights loaded, routed experts left in the files."""

    path: pathlib.Path  # the model directory
    model: PreTrainedModel  # eval mode, attention through sdpa, expert parameters empty
    tokenizer: PreTrainedTokenizerBase | None  # None when the directory has no tokenizer
    experts_by_layer: dict[int, torch.nn.Module]  # decoder layer index -> routed experts module
    top_k: int  # experts per token
    num_experts: int  # routed experts per MoE layer
    reader: ExpertReader  # one expert at a time from the checkpoint files, checked against the manifest
    dtype: torch.dtype  # compute dtype (the checkpoint's unless overridden)
    checkpoint_dtype: torch.dtype  # dtype of the routed experts in the files
    dense_digests: dict[str, str]  # dense weight name -> xxh3-64 of the bytes the loader assigned


def _read_config(path: pathlib.Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is a file, not a checkpoint directory")
    config_file = path / "config.json"
    if not config_file.exists():
        found = sorted(p.name for p in path.iterdir())[:10]
        raise CheckpointError(f"{path} is not a checkpoint: no config.json (found: {found or 'nothing'})")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"{config_file}: cannot read: {exc.strerror or exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def first_line(exc: BaseException) -> str:
    """An exception's message on one line (its first non-empty line, or its type's name)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _load_tokenizer(path: pathlib.Path) -> PreTrainedTokenizerBase:
    """The directory's tokenizer; a failure names the tokenizer file at fault and what is wrong with it."""
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # tokenizers and transformers raise many kinds for a bad file
        for name in TOKENIZER_FILES:  # diagnosed only after a failure: a real tokenizer.json is megabytes
            file = path / name
            if not file.exists():
                continue
            try:
                json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as bad:
                raise CheckpointError(f"{file} is not valid JSON: {bad}") from exc
            except OSError as bad:
                raise CheckpointError(f"{file}: cannot read: {bad.strerror or bad}") from exc
        file = path / ("tokenizer.json" if (path / "tokenizer.json").exists() else "tokenizer_config.json")
        raise CheckpointError(f"{file}: transformers could not load the tokenizer: {first_line(exc)}") from exc


def _check_supported(path: pathlib.Path, config: dict) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not a supported MoE architecture (supported: {supported})"
        )


def _top_k(config: object) -> int:
    for name in ("num_experts_per_tok", "moe_top_k", "top_k"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise CheckpointError("could not find the number of experts per token in the config")


def find_experts_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Map decoder layer index -> the routed-experts module that uses transformers' experts interface."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "has_gate")):
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            continue
        if module.has_bias or module.is_transposed or not module.has_gate or not module.is_concatenated:
            raise CheckpointError(f"experts module {name} uses a weight layout the engine does not support yet")
        found[int(match.group(1))] = module
    return found


def find_routers(model: torch.nn.Module, experts: dict[int, torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """Map decoder layer index -> its router: the experts module's sibling ``gate`` or ``router`` with a
    [num_experts, hidden] weight (layers whose router has another form are left out)."""
    parents = {module: name.rpartition(".")[0] for name, module in model.named_modules()}
    found: dict[int, torch.nn.Module] = {}
    for layer, module in experts.items():
        parent = model.get_submodule(parents[module])
        for attr in ("gate", "router"):
            router = getattr(parent, attr, None)
            weight = getattr(router, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == module.num_experts:
                found[layer] = router
                break
    return found


def _checkpoint_dtype(files: CheckpointFiles, sources: dict) -> torch.dtype:
    if not sources:
        raise CheckpointError(f"{files.path}: no routed-expert tensors (names like ...experts.0.gate_proj.weight)")
    name = next(iter(sources.values())).parts[0][0]
    return files.dtype(name)


def _config_dtype(config: dict) -> torch.dtype:
    """An FP8 checkpoint's compute dtype: the one its config names (bf16 when it names none)."""
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return (
        dtype
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and not fp8.is_fp8(dtype)
        else (fp8.DEFAULT_COMPUTE_DTYPE)
    )


def _meta_model(path: pathlib.Path, compute: torch.dtype) -> torch.nn.Module:
    """The model built by transformers from `path`'s config on the meta device, its routed experts run by
    our experts function (a config transformers cannot build is a :class:`CheckpointError`)."""
    from fallbackgate.engine.experts.hook import EXPERTS_IMPLEMENTATION, register_experts_function

    register_experts_function()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(
                    config, dtype=compute, attn_implementation="sdpa", experts_implementation=EXPERTS_IMPLEMENTATION
                )
    except Exception as exc:  # transformers raises many kinds for a config it cannot build; all mean "cannot load"
        raise CheckpointError(
            f"{path / 'config.json'}: transformers could not build the model from it: {first_line(exc)}"
        ) from exc
    return model


def load_checkpoint(
    path: str | pathlib.Path, *, dtype: torch.dtype | None = None, is_tokenizer_required: bool = False
) -> LoadedCheckpoint:
    """Build `path`'s model on the meta device, load its dense weights, and leave the experts to a reader.

    Weights keep the checkpoint's dtype unless `dtype` overrides the compute dtype; routed experts are never
    materialised in the model (the expert store reads them one at a time through the returned reader).
    """
    path = pathlib.Path(path)
    config_dict = _read_config(path)
    _check_supported(path, config_dict)
    files = CheckpointFiles(path)
    checkpoint_dtype = _checkpoint_dtype(files, map_experts(files))
    compute = dtype or (_config_dtype(config_dict) if fp8.is_fp8(checkpoint_dtype) else checkpoint_dtype)
    model = _meta_model(path, compute)
    model.eval()
    experts = find_experts_modules(model)
    if not experts:
        raise CheckpointError(f"{path}: {config_dict.get('model_type')} model has no routed-experts layers")
    for module in experts.values():
        for name in ("gate_up_proj", "down_proj"):
            setattr(module, name, torch.nn.Parameter(torch.empty(0, dtype=compute), requires_grad=False))
    dense_digests = load_dense_weights(model, files, compute)
    reader = ExpertReader(files, compute)
    first = next(iter(experts.values()))
    expected = {(layer, e) for layer in experts for e in range(int(first.num_experts))}
    if set(reader.sources) != expected:
        missing = sorted(expected - set(reader.sources))[:4]
        raise CheckpointError(f"{path}: expert tensors do not match the config's experts (e.g. missing {missing})")
    tokenizer = None
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        tokenizer = _load_tokenizer(path)
    elif is_tokenizer_required:
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json) next to the weights")
    top_k, num_experts = _top_k(model.config), int(first.num_experts)
    return LoadedCheckpoint(
        path, model, tokenizer, experts, top_k, num_experts, reader, compute, checkpoint_dtype, dense_digests
    )
