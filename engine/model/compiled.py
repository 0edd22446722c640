"""The decode forward compiled whole by ``torch.compile`` (`EngineConfig.is_decode_compiled`).

A forward whose every request decodes one token runs through one compiled graph of the model's own modules
(inductor; a graph per batch shape until the shapes turn dynamic), the engine's K/V update, attention and
experts called inside it as custom operators (`compiled_ops`): what those do — decide and serve misses, read
and write the paged store, record every use — is the eager engine's own code, unchanged. Prefill chunks, KV
rebuilds and the audit's passes stay eager. Compiled code fuses the model's elementwise work, so its logits
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


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode cannot be compiled with the engine's operators (None: it can)."""
    for layer, module in attention_modules(model).items():
        if hasattr(module, "expand_kv"):
            return f"layer {layer} caches MLA latents (expanded per request by the eager attention function)"
        if getattr(module, "sliding_window", None) is not None:
            return f"layer {layer} attends over a sliding window, which the compiled operator does not pass on"
    return None


def kept_guards(entries: list) -> list[bool]:
    """Which of dynamo's guards a call of the compiled forward checks: torch's global state, everything about
    the call's arguments (tensor shapes and dtypes, the cache's type and layers, the engine handles baked into
    the graph) and the model's class and handles — not the ~1,400 guards on the model's own parameters,
    attributes, hooks and transformers' module globals, which the engine never changes after it is built and
    which cost about as much as the rest of a decode's compiled graph to check each call."""
    return [
        entry.is_global
        or entry.name.startswith("kwargs")
        or entry.name.endswith(("handle", "_fg_handle"))
        or (entry.name == "self" and entry.guard_type == "TYPE_MATCH")
        for entry in entries
    ]


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

        self.handle = compiled_ops.register(compiled_ops.OpTarget(executor.kv_update, attend, run_experts))
        for module in (*attention.values(), *experts_by_layer.values()):
            module._fg_handle = self.handle
        # the C++ wrapper calls the graph's kernels without a Python frame each (on a CPU: ~15 % of a decode)
        options = {"cpp_wrapper": True, "guard_filter_fn": kept_guards}
        self.forward = torch.compile(model, fullgraph=True, options=options)
        self.num_forwards = 0  # decode forwards run compiled

    @staticmethod
    def takes(batch: ForwardBatch) -> bool:
        """True for a forward the compiled graph runs: every request decodes one token."""
        return all(length == 1 for length in batch.lengths)

    def close(self) -> None:
        """Unregister the operators' target (the engine serves no more)."""
        compiled_ops.unregister(self.handle)
