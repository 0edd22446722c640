"""Fit a :class:`HardwareProfile` to measurements: a roofline per expert call (fixed cost + the slower of
streaming the weights and the FLOPs), a fixed dense cost per decoder layer, and the measured links."""

from __future__ import annotations

import dataclasses
import datetime as dt

from fallbackgate.engine.disk_model import DiskTable
from fallbackgate.engine.hardware import ExpertCurve, HardwareProfile
from fallbackgate.profiling.measure import ExpertTiming
from fallbackgate.profiling.names import MEASURED

BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(slots=True)
class RooflineFit:
    """Expert-call rates of one device: fixed cost, weight streaming rate and FLOP rate."""

    call_s: float  # seconds of the smallest call
    bytes_per_s: float  # weight bytes streamed per second (batch-1 calls of the largest expert)
    flops: float  # FLOP/s (the largest batch of the largest expert)

    def predict_s(self, t: ExpertTiming) -> float:
        streaming = t.num_params * BYTES_PER_ELEMENT[t.dtype] / self.bytes_per_s
        return self.call_s + max(streaming, 2.0 * t.num_params * t.num_tokens / self.flops)


def fit_roofline(timings: list[ExpertTiming]) -> RooflineFit:
    """The three rates from one device's timings (one dtype); every rate stays positive."""
    call_s = min(t.seconds for t in timings)
    largest = max(t.num_params for t in timings)
    big = [t for t in timings if t.num_params == largest]
    single = min(big, key=lambda t: t.num_tokens)
    batch = max(big, key=lambda t: t.num_tokens)
    weight_bytes = single.num_params * BYTES_PER_ELEMENT[single.dtype]
    bytes_per_s = weight_bytes / max(single.seconds - call_s, 1e-9)
    flops = 2.0 * batch.num_params * batch.num_tokens / max(batch.seconds - call_s, 1e-9)
    return RooflineFit(call_s, bytes_per_s, flops)


def fit_errors(fit: RooflineFit, timings: list[ExpertTiming]) -> list[float]:
    """Predicted ÷ measured seconds of every timing (1.0 is a perfect fit)."""
    return [fit.predict_s(t) / t.seconds for t in timings]


def fit_curve(timings: list[ExpertTiming]) -> ExpertCurve:
    """The measured curve of one device and dtype: seconds per weight byte of the largest expert by token
    count, after the fixed cost of the smallest call."""
    call_s = min(t.seconds for t in timings)
    largest = max(t.num_params for t in timings)
    big = sorted((t for t in timings if t.num_params == largest), key=lambda t: t.num_tokens)
    rates = [max(t.seconds - call_s, 0.0) / (t.num_params * BYTES_PER_ELEMENT[t.dtype]) for t in big]
    return ExpertCurve(call_s, tuple(t.num_tokens for t in big), tuple(rates))


def curve_errors(curve: ExpertCurve, timings: list[ExpertTiming]) -> list[float]:
    """Predicted ÷ measured seconds of every timing under the curve (1.0 is a perfect fit)."""
    return [curve.predict_s(t.num_tokens, t.num_params * BYTES_PER_ELEMENT[t.dtype]) / t.seconds for t in timings]


def group_timings(timings: list[ExpertTiming], device_kind: str) -> dict[str, list[ExpertTiming]]:
    """Timings by "cpu/<dtype>" and "device/<dtype>" (on a CPU-only machine the CPU is the device)."""
    groups: dict[str, list[ExpertTiming]] = {}
    for t in timings:
        if t.device == "cpu":
            names = ["cpu", "device"] if device_kind == "cpu" else ["cpu"]
        else:
            names = ["device"]
        for name in names:
            groups.setdefault(f"{name}/{t.dtype}", []).append(t)
    return groups


def build_profile(
    machine: str,
    links: dict[str, float],
    rooflines: dict[str, RooflineFit],
    curves: dict[str, ExpertCurve],
    dtype: str,
    decode_step_s: float,
    num_layers: int,
    num_moe_layers: int,
    bundled_expert_s: float,
    engine_steps: tuple[float, float, int, int, int] | None = None,
    disk: DiskTable | None = None,
) -> HardwareProfile:
    """The measured profile; its scalar expert rates are `dtype`'s. `links` holds the four measured link
    rates by field name; a decoder layer's fixed dense cost is the bundled model's batch-1 decode step less
    the two routed experts of each MoE layer, per layer. `engine_steps` (the engine's decode step at batch 1
    and 6, see ``measure_engine_steps``) gives the engine's own cost per step and per request; `disk` is the
    disk's measured table (:mod:`fallbackgate.profiling.disk`)."""
    cpu, device = rooflines[f"cpu/{dtype}"], rooflines[f"device/{dtype}"]
    layer_s = max((decode_step_s - 2 * num_moe_layers * bundled_expert_s) / num_layers, 0.0)
    step_s = request_s = 0.0
    if engine_steps is not None:  # the engine at batch 1 and B against the model's own batch-1 step
        one, many, moe_layers, experts, top_k = engine_steps
        batch = 6
        unique = [experts * (1 - (1 - top_k / experts) ** n) for n in (1, batch)]
        extra_experts_s = moe_layers * (unique[1] - unique[0]) * bundled_expert_s
        step_s = max(one - decode_step_s, 0.0)
        request_s = max((many - one - extra_experts_s) / (batch - 1), 0.0)
    return HardwareProfile(
        name=MEASURED,
        host_to_device_bytes_per_s=links["host_to_device_bytes_per_s"],
        device_to_host_bytes_per_s=links["device_to_host_bytes_per_s"],
        disk_to_host_bytes_per_s=links["disk_to_host_bytes_per_s"],
        host_to_disk_bytes_per_s=links["host_to_disk_bytes_per_s"],
        device_flops=device.flops,
        cpu_expert_flops=cpu.flops,
        link_latency_s=0.0,
        device_bytes_per_s=device.bytes_per_s,
        cpu_expert_bytes_per_s=cpu.bytes_per_s,
        expert_call_s=device.call_s,
        layer_overhead_s=layer_s,
        step_overhead_s=step_s,
        request_overhead_s=request_s,
        is_measured=True,
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        machine=machine,
        expert_curves=curves,
        disk=disk,
    )
