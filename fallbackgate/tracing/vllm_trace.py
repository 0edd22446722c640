"""``fallbackgate trace import-vllm``: vLLM's routed-experts output (:mod:`~fallbackgate.tracing.vllm_routing`) as
a trace (format v1). ``expert_access`` is vLLM's routing; everything vLLM does not return is synthesised, and
``metadata.json`` says which (``synthesized``) and how (``synthesis``):

- steps: every request arrives at 0 and is prefilled in step 0 (all prompts in one batch); decode step s
  forwards each request's token at position ``prompt + s - 1`` while it has one; each step lasts ``step_ns``
  (vLLM returns no times);
- expert rows: one per (position, MoE layer, rank), tier ``device``, tag ``resident``, 0 bytes and 0 ns (vLLM
  keeps every expert on the GPU); ``router_weight`` is empty-valued (NaN): vLLM returns ids only;
- KV rows: in each step every running request reads blocks ``0..ceil(context / block_size) - 1`` of its table
  in every decoder layer, ``context`` being its tokens up to and including the step's (as the live recorder
  records reads); the requests table from the prompt and output lengths on the same clock.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fallbackgate.tracing.access_columns import KVPending
from fallbackgate.tracing.schema import TraceFormatError, TraceTable
from fallbackgate.tracing.vllm_routing import RoutedRequest, moe_layer_map, read_routed_file
from fallbackgate.tracing.writer import Indexed, TraceWriter

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def read_model_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint directory's (or a file's) Hugging Face ``config.json``."""
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{file}: not a readable config.json: {exc}") from exc


def model_metadata(config: Mapping[str, Any] | None, moe_layers: list[int], num_axis: int, top_k: int,
                   max_expert: int, block_size: int, path: str | None) -> dict[str, Any]:  # fmt: skip
    """``metadata.json``'s model: shape from the config when given (else from the routing), and object sizes
    computed from it (gate, up and down projections per expert; K and V per KV block and layer)."""
    if config is None:
        return {"num_layers": num_axis, "num_moe_layers": len(moe_layers), "moe_layers": moe_layers,
                "num_experts": max_expert + 1, "top_k": top_k, "block_size": block_size}  # fmt: skip
    itemsize = DTYPE_BYTES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), 2)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    inner = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    return {
        "num_layers": int(config["num_hidden_layers"]), "num_moe_layers": len(moe_layers), "moe_layers": moe_layers,
        "num_experts": int(experts or max_expert + 1), "top_k": int(config.get("num_experts_per_tok") or top_k),
        "bytes_per_expert": 3 * hidden * inner * itemsize,
        "bytes_per_kv_block": 2 * kv_heads * head_dim * block_size * itemsize, "block_size": block_size,
        "dtype": str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), "path": path,
    }  # fmt: skip


def _expert_columns(requests: list[RoutedRequest], layer_of: list[int]) -> dict[str, Any]:
    """``expert_access`` columns of every request, in step order (request codes index ``requests``)."""
    keep = np.array([i for i, layer in enumerate(layer_of) if layer >= 0], dtype=np.int64)
    parts: dict[str, list[np.ndarray]] = {"step": [], "request": [], "layer": [], "expert": []}
    k = next((r.routed.shape[2] for r in requests if len(r.routed)), 1)
    for code, r in enumerate(requests):
        routed = r.routed[:, keep, :]  # [positions, MoE layers, k]
        step = np.concatenate([np.zeros(r.prompt_tokens, np.int64), np.arange(1, len(routed) - r.prompt_tokens + 1)])
        rows = routed.size
        parts["step"].append(np.repeat(step[: len(routed)], len(keep) * k))
        parts["request"].append(np.full(rows, code, dtype=np.int64))
        parts["layer"].append(np.tile(np.repeat(np.array(layer_of)[keep], k), len(routed)))
        parts["expert"].append(routed.reshape(-1))
    cat = {n: np.concatenate(v) if v else np.zeros(0, np.int64) for n, v in parts.items()}
    order = np.argsort(cat["step"], kind="stable")
    cat = {n: v[order] for n, v in cat.items()}
    rows = len(order)
    return {
        **cat, "router_rank": np.tile(np.arange(k), rows // k), "router_weight": np.full(rows, np.nan, np.float32),
        "tier_before": np.zeros(rows, np.int32), "tag": np.zeros(rows, np.int32), "bytes": np.zeros(rows, np.int64),
        "ns": np.zeros(rows, np.int64), "is_predicted": np.zeros(rows, dtype=bool),
    }  # fmt: skip


def _kv_columns(requests: list[RoutedRequest], num_layers: int, block_size: int) -> dict[str, Any]:
    """Synthesised ``kv_access`` columns: each running request's blocks per step, in every layer."""
    pending = KVPending()
    last = max(r.output_tokens - 1 for r in requests)
    for step in range(last + 1):
        for code, r in enumerate(requests):
            if step <= max(r.output_tokens - 1, 0):
                context = r.prompt_tokens + step
                pending.steps.append(step)
                pending.requests.append(code)
                pending.blocks.append(-(-context // block_size))
    return pending.columns(num_layers)


def import_vllm(
    path: str | os.PathLike[str], out: str | os.PathLike[str], config_path: str | None = None, block_size: int = 16,
    step_ns: int = 1_000_000, workload: str | None = None,
) -> dict[str, int]:  # fmt: skip
    """Write the trace of vLLM routed-experts file ``path`` into the new directory ``out``; returns rows per table."""
    if block_size < 1 or step_ns < 1:
        raise TraceFormatError(f"block size and step time must be positive, got {block_size} and {step_ns}")
    requests = read_routed_file(path)
    config = read_model_config(config_path) if config_path else None
    layer_of = moe_layer_map(requests, config)
    shaped = next((r.routed for r in requests if len(r.routed)), np.zeros((0, 0, 1), np.int64))
    max_expert = int(max((r.routed.max(initial=0) for r in requests), default=0))
    model = model_metadata(config, [x for x in layer_of if x >= 0], shaped.shape[1], shaped.shape[2], max_expert,
                           block_size, config_path)  # fmt: skip
    if max_expert >= model["num_experts"]:
        raise TraceFormatError(f"{path}: expert id {max_expert} out of range for {model['num_experts']} experts")
    names = [r.request_id for r in requests]
    num_steps = max(max(r.output_tokens - 1, 0) for r in requests) + 1
    metadata = {
        "source": "vllm", "workload": workload or Path(path).stem, "model": model, "budgets": {},
        "controller": None, "profile": {}, "synthesized": ["steps", "kv_access", "requests"],
        "synthesis": {
            "expert_access": "vLLM's routed experts (ids only: router_weight NaN; all resident on the GPU)",
            "kv_access": f"blocks 0..ceil(context/{block_size})-1 of every running request, every layer, per step",
            "steps": f"all requests prefilled in step 0, then one decode step per token; {step_ns} ns per step",
        },
        "vllm": {"file": str(path), "layouts": sorted({r.layout for r in requests}), "step_ns": step_ns},
    }  # fmt: skip
    with TraceWriter(out, metadata) as writer:
        steps = np.arange(num_steps)
        batch = [sum(1 for r in requests if s <= max(r.output_tokens - 1, 0)) for s in range(num_steps)]
        tokens = [sum(r.prompt_tokens for r in requests)] + batch[1:]
        writer.append(TraceTable.STEPS, step=steps, phase=["prefill"] + ["decode"] * (num_steps - 1),
                      start_ns=steps * step_ns, end_ns=(steps + 1) * step_ns, batch=batch, tokens=tokens)  # fmt: skip
        experts = _expert_columns(requests, layer_of)
        writer.append(TraceTable.EXPERT_ACCESS, **{**experts, "request": Indexed(names, experts["request"])})
        kv = _kv_columns(requests, int(model["num_layers"]), block_size)
        writer.append(TraceTable.KV_ACCESS, **{**kv, "request": Indexed(names, kv["request"])})
        finish = [(max(r.output_tokens - 1, 0) + 1) * step_ns for r in requests]
        writer.append(
            TraceTable.REQUESTS, request=names, request_class=["vllm"] * len(names), slo_ttft_ns=None,
            slo_tpot_ns=None, arrival_ns=[0] * len(names),
            first_token_ns=np.array([step_ns if r.output_tokens else None for r in requests], dtype=object),
            finish_ns=finish, prompt_tokens=[r.prompt_tokens for r in requests],
            output_tokens=[r.output_tokens for r in requests],
        )  # fmt: skip
        rows = writer.num_rows
    return rows
