"""Reading vLLM's routed-experts output (``--enable-return-routed-experts``): per request, the expert ids its
router chose for every token at every layer, as vLLM's OpenAI-compatible server returns them.

The layouts (checked against vLLM's own code; README "Importing vLLM's routed experts" cites files and
versions):

- **full** (``vllm/entrypoints/openai/completion/protocol.py``, ``CompletionResponseChoice.routed_experts``):
  a string, base64 of ``.npy`` bytes (``np.load(io.BytesIO(base64.b64decode(s)))``), shape
  ``(num_tokens - 1, num_layers, num_experts_per_tok)``, dtype uint8, uint16 or int32: the prompt's tokens
  then the generated ones, without the last sampled token (never forwarded). The same array, as nested
  lists, is what ``CompletionOutput.routed_experts`` (``vllm/outputs.py``, ``[seq_len, layer_num, topk]``)
  holds offline, written here as a JSON list of lists.
- **split** (vLLM 0.21's ``docs/training/routed_experts_replay.md``): ``prompt_routed_experts`` on the
  response ``[prompt_len, num_moe_layers, top_k]`` plus ``routed_experts`` per choice ``[gen_len, ...]``,
  both nested lists.

The layer axis is either every decoder layer (vLLM's capturer sizes it by ``num_hidden_layers``; dense
layers are never captured and stay zero) or the MoE layers only; :func:`moe_layer_map` decides which from
the model's config, or, without one, drops layers that are all zero (a real top-k > 1 never repeats an id).
A request's prompt length comes from the choice's ``prompt_token_ids`` or the response's
``usage.prompt_tokens``; its output length from ``token_ids``, else ``usage.completion_tokens`` (one choice).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fallbackgate.tracing.schema import TraceFormatError


@dataclasses.dataclass(slots=True)
class RoutedRequest:
    """One request's routing as vLLM returned it."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    routed: np.ndarray  # [positions, layers, top_k] int: position p's expert ids, rank order
    layout: str  # "full" or "split"


def decode_routed(value: Any, where: str) -> np.ndarray:
    """One ``routed_experts`` value (base64 ``.npy`` string or nested lists) as an int array [n, layers, k]."""
    if isinstance(value, str):
        try:
            array = np.load(io.BytesIO(base64.b64decode(value, validate=True)), allow_pickle=False)
        except (binascii.Error, ValueError, OSError) as exc:
            raise TraceFormatError(f"{where}: not base64 of .npy bytes: {exc}") from exc
    else:
        try:
            array = np.asarray(value)
        except ValueError as exc:
            raise TraceFormatError(f"{where}: ragged nested lists: {exc}") from exc
        if array.size == 0:  # no positions (a request generating one token, in the split layout)
            array = np.zeros((0, 0, 0), dtype=np.int64)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise TraceFormatError(f"{where}: expected integer [tokens, layers, top_k], got {array.dtype} {array.shape}")
    return array.astype(np.int64)


def _lengths(response: Mapping[str, Any], choice: Mapping[str, Any], where: str) -> tuple[int, int]:
    usage = response.get("usage") or {}
    prompt = choice.get("prompt_token_ids")
    prompt_len = len(prompt) if prompt is not None else usage.get("prompt_tokens")
    output = choice.get("token_ids")
    single = len(response.get("choices") or ()) == 1
    output_len = len(output) if output is not None else usage.get("completion_tokens") if single else None
    if not isinstance(prompt_len, int) or not isinstance(output_len, int):
        raise TraceFormatError(f"{where}: needs prompt_token_ids or usage.prompt_tokens, and token_ids (or, with "
                               "one choice, usage.completion_tokens)")  # fmt: skip
    return prompt_len, output_len


def requests_of(response: Mapping[str, Any], where: str) -> Iterator[RoutedRequest]:
    """The routed requests of one OpenAI completion or chat completion response."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise TraceFormatError(f"{where}: not a completion response (no choices)")
    prompt_part = response.get("prompt_routed_experts")
    for position, choice in enumerate(choices):
        index = choice.get("index", position)
        here = f"{where}.choices[{index}]"
        if choice.get("routed_experts") is None:
            raise TraceFormatError(f"{here}: no routed_experts (was the server started with "
                                   "--enable-return-routed-experts?)")  # fmt: skip
        prompt_len, output_len = _lengths(response, choice, here)
        routed = decode_routed(choice["routed_experts"], f"{here}.routed_experts")
        layout = "full"
        if prompt_part is not None:
            layout, head = "split", decode_routed(prompt_part, f"{where}.prompt_routed_experts")
            if head.shape[1:] != routed.shape[1:] and len(routed):
                raise TraceFormatError(f"{here}: prompt and generated routing differ in shape {head.shape[1:]} "
                                       f"vs {routed.shape[1:]}")  # fmt: skip
            routed = np.concatenate([head, routed.reshape(-1, *head.shape[1:]) if routed.size else head[:0]])
        expected = prompt_len + output_len - 1
        if not expected <= len(routed) <= expected + 1:
            raise TraceFormatError(f"{here}: {len(routed)} routed positions for {prompt_len} prompt and {output_len} "
                                   f"generated tokens (vLLM returns {expected})")  # fmt: skip
        request_id = str(response.get("id", where)) + (f"-{index}" if len(choices) > 1 else "")
        yield RoutedRequest(request_id, prompt_len, output_len, routed[:expected], layout)


def read_routed_file(path: str | os.PathLike[str]) -> list[RoutedRequest]:
    """Every routed request of a JSON file (one response, a list of them) or JSON-lines file (one a line)."""
    file = Path(path)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{file}: unreadable: {exc}") from exc
    try:
        loaded = json.loads(text)
        responses = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError:
        try:
            responses = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{file}: neither JSON nor JSON lines: {exc}") from exc
    requests = [r for i, resp in enumerate(responses) for r in requests_of(resp, f"{file.name}[{i}]")]
    if not requests:
        raise TraceFormatError(f"{file}: no responses")
    shapes = {r.routed.shape[1:] for r in requests if len(r.routed)}
    if len(shapes) > 1:
        raise TraceFormatError(f"{file}: responses disagree on [layers, top_k]: {sorted(shapes)}")
    return requests


def moe_layer_map(requests: list[RoutedRequest], config: Mapping[str, Any] | None) -> list[int]:
    """The decoder layer of each index of the routing's layer axis that is an MoE layer (-1: skip it)."""
    num_axis = next((r.routed.shape[1] for r in requests if len(r.routed)), 0)
    if config is None:
        k = next((r.routed.shape[2] for r in requests if len(r.routed)), 0)
        used = np.zeros(num_axis, dtype=bool)
        for r in requests:
            used |= r.routed.any(axis=(0, 2)) if len(r.routed) else used
        return [i if used[i] or k == 1 else -1 for i in range(num_axis)]
    num_layers = int(config["num_hidden_layers"])
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first_dense = int(config.get("first_k_dense_replace") or 0)
    moe = [i for i in range(num_layers) if i not in dense and i >= first_dense and (i + 1) % step == 0]
    if num_axis == num_layers:
        return [i if i in moe else -1 for i in range(num_layers)]
    if num_axis == len(moe):
        return moe
    raise TraceFormatError(f"the routing has {num_axis} layers; the model has {num_layers} ({len(moe)} MoE)")
