"""The benchmarks' engines, built by the one assembly (:func:`fallbackgate.assembly.assemble`).

A benchmark measures the engine in exact mode: the policy of a run without a policy file (the exact-only LRU
controller, enforce mode) with the engine's default hardware profile, the CPU box, for modeled time (not the
machine's measured profile: a benchmark measures nothing before it starts), and what it sets beside the policy
(device, budgets in bytes, request length, read-ahead threads) as :class:`Overrides`.
"""

from __future__ import annotations

from fallbackgate.assembly import Assembly, Overrides, assemble, no_policy
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.policy.schema import Policy


def exact_policy(model: str, *, max_num_seqs: int | None = None, compile_decode: bool = False) -> Policy:
    """The benchmarks' policy for checkpoint ``model``; ``max_num_seqs``: running requests at most (None: the
    policy's default); ``compile_decode``: decode forwards compiled."""
    memory: dict[str, object] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    hardware: dict[str, object] = {"profile": CPU_BOX.name, "compile_decode": compile_decode}
    return no_policy(model, hardware=hardware, memory=memory)


def exact_assembly(
    model: str, overrides: Overrides | None = None, *, max_num_seqs: int | None = None, compile_decode: bool = False
) -> Assembly:
    """The exact-mode engine of checkpoint ``model`` (see :func:`exact_policy`) with ``overrides``."""
    return assemble(exact_policy(model, max_num_seqs=max_num_seqs, compile_decode=compile_decode), overrides)
