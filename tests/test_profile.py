"""The measured hardware profile: the curve fit, the per-machine cache, the command, and the controller's
use of measured time (a step's cpu_execute experts add up against its deadline; a late exact KV copy is
arbitrated against the step's expert loads)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from fallbackgate.cli import main
from fallbackgate.controllers import make_controller
from fallbackgate.engine.controller import ExpertMiss, KVBlockInfo, KVMiss
from fallbackgate.engine.hardware import CPU_BOX, ExpertCurve, HardwareProfile
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass
from fallbackgate.profiling import store
from fallbackgate.profiling.fit import curve_errors, fit_curve
from fallbackgate.profiling.measure import ExpertTiming, measure_disk
from tests.test_controllers import EXPERT_BYTES, fake_view


def _timings(call_s: float, s_per_byte: dict[int, float]) -> list[ExpertTiming]:
    out = []
    for hidden, inter in ((64, 32), (512, 256)):
        for tokens, rate in s_per_byte.items():
            seconds = call_s + rate * 3 * hidden * inter * 4 if hidden == 512 else call_s
            out.append(ExpertTiming("cpu", "float32", hidden, inter, tokens, seconds))
    return out


def test_curve_fit_recovers_the_rates_and_interpolates() -> None:
    timings = _timings(20e-6, {1: 1e-10, 4: 2e-10, 16: 8e-10})
    curve = fit_curve(timings)
    assert curve.call_s == pytest.approx(20e-6)
    assert curve.num_tokens == (1, 4, 16)
    assert curve.s_per_byte == pytest.approx((1e-10, 2e-10, 8e-10))
    big = [t for t in timings if t.hidden == 512]
    assert curve_errors(curve, big) == pytest.approx([1.0, 1.0, 1.0])
    # halfway between 4 and 16 tokens: halfway between the two rates
    assert curve.predict_s(10, 1_000_000) == pytest.approx(20e-6 + 5e-10 * 1_000_000)
    assert curve.predict_s(64, 1_000_000) == pytest.approx(20e-6 + 3.2e-9 * 1_000_000)  # beyond: the last slope


def test_profile_predicts_from_its_curve_per_device_and_dtype() -> None:
    curve = ExpertCurve(10e-6, (1, 64), (1e-10, 1e-9))
    profile = dataclasses.replace(CPU_BOX, expert_curves={"cpu/bfloat16": curve})
    assert profile.expert_s(1, 2_000_000, 1_000_000, on_cpu=True, dtype="bfloat16") == pytest.approx(210e-6)
    # no curve for the device: the roofline of the scalar rates (2 FLOPs per parameter per token)
    assert profile.expert_s(4, 2_000_000, 1_000_000, on_cpu=False, dtype="bfloat16") == pytest.approx(8e6 / 40e9)


def test_profile_file_round_trips_and_bad_files_name_themselves(tmp_path: pathlib.Path) -> None:
    curve = ExpertCurve(10e-6, (1, 64), (1e-10, 1e-9))
    profile = dataclasses.replace(CPU_BOX, name="measured", is_measured=True, expert_curves={"cpu/float32": curve})
    path = tmp_path / "p.json"
    store.save_profile(path, profile, {"note": "raw"})
    assert store.load_profile_file(path) == profile
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\x00\xff not json")
    with pytest.raises(store.ProfileFileError, match="bad.json"):
        store.load_profile_file(bad)


def test_measured_profile_is_measured_once_then_cached(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.delenv(store.ENV_PROFILE, raising=False)
    monkeypatch.setenv(store.ENV_CACHE, str(tmp_path))
    calls = []

    def fake_measure(*args: object, **kwargs: object) -> tuple[HardwareProfile, dict]:
        calls.append(1)
        return dataclasses.replace(CPU_BOX, name="measured", is_measured=True, machine=store.machine_key()), {}

    monkeypatch.setattr("fallbackgate.profiling.run.measure_machine", fake_measure)
    first = store.resolve_profile("measured")
    second = store.resolve_profile("measured")
    assert first == second and first.is_measured and len(calls) == 1
    assert store.cache_path().parent.parent == tmp_path
    store.measured_profile(refresh=True, quiet=True)
    assert len(calls) == 2
    assert store.resolve_profile("pcie4-gpu-nvme").name == "pcie4-gpu-nvme"  # shipped what-ifs stay by name


def test_cold_disk_read_is_measured(tmp_path: pathlib.Path) -> None:
    write_rate, read_rate = measure_disk(tmp_path, 32 * 1024 * 1024)
    assert write_rate > 1e6 and read_rate > 1e6
    assert not list(tmp_path.iterdir())  # the scratch file is gone


def test_profile_command_prints_the_pinned_profile_and_checks_out(tmp_path: pathlib.Path, capsys) -> None:
    assert main(["profile", "--json", "--out", str(tmp_path / "copy.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["name"] == "tests-fixed"
    assert store.load_profile_file(tmp_path / "copy.json").name == "tests-fixed"
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--out", str(tmp_path / "missing" / "p.json")])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_cpu_execute_time_adds_up_within_a_step() -> None:
    """Each cpu_execute consumes its measured time from the step's CPU time; once the CPU is booked the
    next late miss gets the next allowed fallback instead."""
    curve = ExpertCurve(1e-3, (1,), (0.0,))  # one CPU expert call: 1 ms
    profile = HardwareProfile("t", 1e8, 1e8, 1e8, 1e8, 1e12, 1e12, 0.0, expert_curves={"cpu/float32": curve})
    budget = QualityBudget(
        max_mean_kl=10.0,
        max_p99_kl=10.0,
        max_approx_fraction=1.0,
        allowed_tags=["cpu_execute", "expert_defer"],
        min_top1_agreement=0.0,
    )
    policy = Policy(classes={"c": RequestClass(slo=SLO(tpot_ms=2.5, ttft_ms=25), budget=budget)}, default_class="c")
    controller = make_controller("joint", policy, top_k=2)
    plan = StepPlan(1, StepKind.DECODE, ["r"], {"r": 1}, {"r": 8})
    controller.on_step_start(plan, fake_view(profile, {"r": "c"}, ["r"]))
    tags = [
        controller.expert_action(
            ExpertMiss(1, "r", "c", 0, e, 1, 0.1, Tier.HOST, EXPERT_BYTES, False, False, "float32")
        ).tag
        for e in range(4)
    ]
    # a 1 MiB load takes 10.5 ms on this link: too late; 2.5 ms of CPU time holds two 1 ms CPU experts
    assert tags == [Tag.CPU_EXECUTE, Tag.CPU_EXECUTE, Tag.EXPERT_DEFER, Tag.EXPERT_DEFER]


def _arbitrated(allowed: list[str], is_experts_resident: bool = True) -> tuple[object, object]:
    """A 1 ms TPOT target, a link on which the block's 64 KiB take 6.6 ms, a fast device: recompute of
    the 32 tokens since the block is predicted well inside the deadline when every expert is on device
    (else the rebuild's expert loads over the same link are later still)."""
    budget = QualityBudget(max_mean_kl=1.0, max_p99_kl=1.0, max_approx_fraction=1.0, allowed_tags=allowed)
    policy = Policy(classes={"c": RequestClass(slo=SLO(tpot_ms=1.0, ttft_ms=10), budget=budget)}, default_class="c")
    controller = make_controller("joint", policy, top_k=2)
    profile = HardwareProfile("t", 1e7, 1e7, 1e7, 1e7, 1e13, 1e13, 0.0, device_bytes_per_s=1e12)
    plan = StepPlan(1, StepKind.DECODE, ["r"], {"r": 1}, {"r": 32})
    spilled = KVBlockInfo(("r", 0, 0), 16, Tier.HOST, None)  # layer 0's block 0 has only a host copy
    view = fake_view(profile, {"r": "c"}, ["r"])
    resident = view.num_layers * view.num_experts * EXPERT_BYTES if is_experts_resident else 0
    view = dataclasses.replace(
        view, num_expert_params=EXPERT_BYTES // 4, kv_blocks=(spilled,),
        device_bytes_by_kind={ObjectKind.EXPERT: resident},
    )  # fmt: skip
    controller.on_step_start(plan, view)
    decision = controller.kv_action(KVMiss(1, "r", "c", 0, 0, Tier.HOST, None, 0, view.bytes_per_kv_block))
    return decision, controller.arbitrations


def test_a_late_exact_kv_copy_is_recomputed_when_the_class_allows() -> None:
    decision, [arbitration] = _arbitrated(["recompute"])
    assert decision.tag is Tag.RECOMPUTE and arbitration.choice is Tag.RECOMPUTE
    assert "exact copy late (6.554 ms of host-to-device link" in decision.reason
    assert "recompute predicted" in decision.reason


def test_a_late_exact_kv_copy_is_not_rebuilt_when_the_rebuild_would_load_the_experts_over_the_same_link() -> None:
    decision, [arbitration] = _arbitrated(["recompute"], is_experts_resident=False)
    assert decision.tag is Tag.EXACT_LOAD and arbitration.choice is Tag.EXACT_LOAD
    options = {o.tag: o for o in arbitration.options}
    assert options[Tag.RECOMPUTE].note == "past the step's CPU time"
    assert options[Tag.RECOMPUTE].predicted_s > options[Tag.EXACT_LOAD].predicted_s  # 1 MiB experts at 10 MB/s


def test_a_late_exact_kv_copy_loads_late_when_nothing_else_is_allowed() -> None:
    decision, [arbitration] = _arbitrated([])
    assert decision.tag is Tag.EXACT_LOAD
    assert arbitration.choice is Tag.EXACT_LOAD and arbitration.reason.endswith("slo slip")
