"""Measured-time predictions every controller shares: a step's deadline and an expert's CPU time."""

from __future__ import annotations

from fallbackgate.engine.controller import ControllerView, ExpertMiss
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.messages import StepPlan
from fallbackgate.policy.schema import Policy, StepTime

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def step_deadline_s(policy: Policy, plan: StepPlan, view: ControllerView) -> float:
    """The step's link and CPU time: the tightest target of its requests (TPOT for decoding requests, TTFT
    for prefill) less the step's fixed time: the dense time the profile predicts, or, when the policy's
    ``controller.step_time`` is ``measured``, the larger of that and the engine's measured decode compute
    time (recent decode steps' wall clock less the disk reads they waited for), so a profile that is
    optimistic about this machine does not hide that the SLO leaves no room for loads."""
    targets = []
    for rid in plan.request_ids:
        cls = policy.classes.get(view.request_class(rid))
        if cls is not None:
            targets.append(cls.slo.tpot_ms if plan.num_tokens[rid] == 1 else cls.slo.ttft_ms)
    dense_s = view.profile.dense_step_s(view.num_layers, 0.0)
    if policy.controller.step_time is StepTime.MEASURED:
        dense_s = max(dense_s, view.measured_compute_s)
    return max((min(targets) if targets else 0.0) / 1000.0 - dense_s, 0.0)


def cpu_expert_s(profile: HardwareProfile, miss: ExpertMiss) -> float:
    """Predicted seconds of the miss's tokens through the expert on the CPU (the measured curve)."""
    params = miss.num_bytes // ELEMENT_BYTES.get(miss.dtype, 4)
    return profile.expert_s(miss.num_tokens, miss.num_bytes, params, on_cpu=True, dtype=miss.dtype)
