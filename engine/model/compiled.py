"""The decode forward compiled whole by ``torch.compile`` (`EngineConfig.is_decode_compiled`).

A forward whose every request runs one token (decodes, a prompt's last one-token chunk) runs through one
compiled graph of the model's own modules (inductor; a graph per batch shape until the shapes turn dynamic),
the engine's K/V update, attention and experts called inside it as custom operators (`compiled_ops`): what
those do — decide and serve misses, read and write the paged store, record every use — is the eager engine's
own code, unchanged; what they raise is raised after the graph returns, as raised. Longer prefill chunks, KV
rebuild passes and the audit's passes stay eager. Compiled code fuses the model's elementwise work, so its logits
are those of the same computation in the same dtype, not bitwise the eager forward's; the audit's exact
baseline (eager) measures the difference like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.kv.paged_attention import paged_attention_forward
from fallbackgate.engine.model import compiled_ops
from fallbackgate.engine.step_context import ForwardBatch

if TYPE_CHECKING:
    from fallbackgate.engine.experts.executor import Executor


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Each decoder layer's attention module (the modules the engine's attention function serves)."""
    return {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}


# model types whose attention modules pass the attention function only dropout, scaling and a sliding window
# (refused when set), all of which the compiled operator honours
COMPILED_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral", "olmoe"})


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode cannot be compiled with the engine's operators (None: it can)."""
    for layer, module in attention_modules(model).items():
        if hasattr(module, "expand_kv"):
            return f"layer {layer} caches MLA latents (expanded per request by the eager attention function)"
        if getattr(module, "sliding_window", None) is not None:
            return f"layer {layer} attends over a sliding window, which the compiled operator does not pass on"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in COMPILED_MODEL_TYPES:
        supported = ", ".join(sorted(COMPILED_MODEL_TYPES))
        return f"model type {model_type!r} is not one whose attention arguments the operator passes ({supported})"
    return None


def kept_guards(entries: list) -> list[bool]:
    """Which of dynamo's guards a call of the compiled forward checks: torch's global state (grad mode, default
    device, ...), the symbolic shapes' relations, everything about the call's arguments (tensor shapes and
    dtypes, the cache's type and layers) and the model's class and engine handles (baked into the graph) — not
    the ~1,400 guards on the model's own parameters, attributes and hooks and on transformers' module globals,
    which the engine never changes after it is built and which cost about as much to check each call as the
    rest of a decode's compiled graph takes."""
    return [
        not entry.name  # torch's global state
        or entry.guard_type == "SHAPE_ENV"
        or entry.name.startswith("kwargs")
        or entry.name.endswith(("handle", "_fg_handle"))
        or (entry.name == "self" and entry.guard_type == "TYPE_MATCH")
        for entry in entries
    ]


def _make_room_for_graphs(handle: int) -> None:
    """Dynamo keeps every engine's graphs on transformers' shared forward code until the process ends (a
    handle is never reused) and a fullgraph compile past its limit is an error: the limits grow with the
    engines compiled so far (a few graphs each)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 8 + 4 * handle)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 256 + 8 * handle)


class CompiledDecode:
    """One engine's compiled decode forward and its operators' registration."""

    def __init__(self, model: torch.nn.Module, executor: Executor, experts_by_layer: dict[int, torch.nn.Module]):
        reason = unsupported_reason(model)
        if reason is not None:
            raise EngineError(f"is_decode_compiled: {reason}")
        attention = attention_modules(model)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            module = attention[layer]
            return paged_attention_forward(module, q, k, v, None, dropout=0.0, scaling=module.scaling)[0]

        def run_experts(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return executor.run_experts(experts_by_layer[layer], layer, hidden, index, weights)

        def kv_update(layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return executor.kv_update(layer, keys, values)

        self.handle = compiled_ops.register(compiled_ops.OpTarget(kv_update, attend, run_experts))
        _make_room_for_graphs(self.handle)
        for module in (*attention.values(), *experts_by_layer.values()):
            module._fg_handle = self.handle
        # the C++ wrapper calls the graph's kernels without a Python frame each (on a CPU: ~15 % of a decode)
        options = {"cpp_wrapper": True, "guard_filter_fn": kept_guards}
        self.forward = torch.compile(model, fullgraph=True, options=options)
        self.num_forwards = 0  # decode forwards run compiled

    @staticmethod
    def takes(batch: ForwardBatch, is_rebuild_pass: bool) -> bool:
        """True for a forward the compiled graph runs: every request runs one token (a decode, or a prompt's
        last one-token chunk: the same computation), and it is not a KV rebuild pass."""
        return not is_rebuild_pass and all(length == 1 for length in batch.lengths)

    def run(self, **inputs: torch.Tensor | object) -> object:
        """The compiled forward; what an engine operator raised in it is raised after it, as raised."""
        self.num_forwards += 1
        try:
            return self.forward(**inputs)
        finally:
            compiled_ops.raise_pending(self.handle)

    def close(self) -> None:
        """Unregister the operators' target (the engine serves no more)."""
        compiled_ops.unregister(self.handle)
