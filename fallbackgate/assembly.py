"""One assembly: a policy plus overrides becomes the run settings, the engine configuration, the controller,
the engine, the request classes and the run's recorder.

Every command that builds an engine to serve goes through :func:`assemble` (``run``, ``serve``, ``parity`` /
``lm-eval``, ``sweep``, the benchmarks). No policy means :func:`no_policy`: the default :class:`Policy`
with the exact-only LRU controller in enforce mode and no declared request classes. Two exact-only engines
sit below this layer and are built where they are used: the audit workers' baseline engine
(``engine/baseline/api.py``) and ``fallbackgate profile``'s step-time probe (``profiling/measure.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable

from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers import ExactLRUController, make_controller
from fallbackgate.controllers.cost import CostModel, load_calibration
from fallbackgate.engine.config import MIB, EngineConfig
from fallbackgate.engine.controller import Controller
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.model.build import resolve_device
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.apply import class_budgets, class_slos, policy_record, with_sections
from fallbackgate.policy.loader import PolicyError, hardware_profile
from fallbackgate.policy.schema import AuditMode, ControllerKind, ControllerSpec, Policy
from fallbackgate.recording import RequestClasses, RunRecorder, RunRow
from fallbackgate.tinymoe import CHECKPOINT_DIR

# what a run without a policy file serves with, as overrides of the default Policy()
NO_POLICY: dict[str, dict[str, object]] = {
    "controller": {"kind": ControllerKind.EXACT_LRU.value},
    "audit": {"mode": AuditMode.ENFORCE.value},
}


def no_policy(model: str | None = None, **sections: dict[str, object]) -> Policy:
    """The policy of a run without a policy file: ``Policy()`` with :data:`NO_POLICY` (then ``sections``:
    section -> field -> value) applied, and ``model`` when given."""
    merged = {name: dict(fields) for name, fields in NO_POLICY.items()}
    for name, fields in sections.items():
        merged.setdefault(name, {}).update(fields)
    return with_sections(Policy(), merged, model)


@dataclasses.dataclass(kw_only=True, slots=True)
class Overrides:
    """What a caller sets beside the policy (flags that name a policy field are merged into the policy first)."""

    max_new_tokens: int = 32  # per request unless its prompt says otherwise
    seed: int = 0  # sampling and the audit sample
    temperature: float = 0.0  # 0: greedy
    dtype: str | None = None  # compute dtype; None: the checkpoint's own
    num_io_threads: int | None = None  # expert read-ahead threads; None: the engine's default
    max_num_batched_tokens: int = 256  # tokens per forward (prefill chunk size)
    audit_cache_mb: float = 256.0  # the audit's own verified expert copies, outside the budgets
    force: tuple[str, ...] = ()  # fallback tags forced on the exact_lru controller (testing)
    is_stacked_when_fits: bool | None = None  # stacked experts without a device budget; None: unless tags are forced
    device_budget_bytes: int | None = None  # exact bytes, winning over the policy's MiB (the sweep's cells)
    host_budget_bytes: int | None = None  # exact bytes, winning over the policy's MiB (0: no host tier)
    max_model_len: int | None = None  # prompt + output tokens per request; None: the engine's default
    device: str | None = None  # "auto", "cpu" or "cuda"; None: the engine's default ("auto")
    expert_fraction: float | None = None  # static_split's expert share; None: the policy's
    is_equivalent_allowed: bool = False  # baselines may serve late misses with the equivalent tags
    wrap_controller: Callable[[Controller], Controller] | None = None  # e.g. a trace recorder around it
    trace_dir: str | None = None  # write the run's trace (format v1) into this new directory; None: no trace
    # test only (never a policy field or a flag): on a CPU, CUDA's device/host tiers emulated as two RAM
    # budgets, so the device/host/cpu_execute logic runs without a GPU; the summary and run row name it
    is_emulated_device_tier: bool = False


@dataclasses.dataclass(kw_only=True, slots=True)
class ControllerSettings:
    """Everything the controller is constructed from (compared by value, e.g. across commands)."""

    kind: str  # a controller kind of the policy schema
    spec: ControllerSpec  # the policy's controller section (bits, decay, split)
    force: tuple[str, ...]  # forced tags (exact_lru only)
    top_k: int  # the model's experts per token, read from the checkpoint's config
    expert_fraction: float  # static_split's expert share of the device budget
    is_equivalent_allowed: bool  # baselines may use the equivalent tags
    cost_model: CostModel | None  # the joint controller's predicted costs (calibrated from a ledger when given)


@dataclasses.dataclass(kw_only=True, slots=True)
class Assembly:
    """A built engine and everything recorded about how it was built."""

    policy: Policy  # the effective policy (overrides merged)
    policy_name: str | None  # the policy file's stem; None: no policy file (no declared classes)
    settings: RunSettings  # what the run serves with (tokens, seed, temperature, knobs)
    engine_config: EngineConfig  # what the engine was built with
    controller_settings: ControllerSettings  # what the controller was built from
    engine: Engine  # the engine, its controller inside
    classes: RequestClasses  # budgets and SLOs per class (empty without a policy file)
    trace_dir: str | None = None  # where the recorder writes the run's trace; None: no trace

    @property
    def audit_rate(self) -> float:
        """Fraction of requests audited: the policy's sample rate."""
        return self.policy.audit.sample_rate

    @property
    def controller(self) -> Controller:
        """The controller the engine consults."""
        return self.engine.controller

    def recorder(self, writer: LedgerWriter, note: str = "") -> RunRecorder:
        """Start this run's ledger run (the run row describes this assembly) and return its recorder."""
        row = RunRow(
            controller=self.controller_settings.kind,
            note=note,
            policy=policy_record(self.policy) if self.policy_name is not None else None,
            policy_name=self.policy_name,
        )
        tracer = None
        if self.trace_dir is not None:
            from fallbackgate.tracing.live import LiveTracer  # pyarrow loads only for traced runs

            meta = {"controller": self.controller_settings.kind, "policy": self.policy_name, "note": note,
                    "workload": pathlib.Path(self.trace_dir).name}  # fmt: skip
            tracer = LiveTracer(self.trace_dir, self.engine, meta)
        return RunRecorder(writer, self.engine, row, self.classes, audit_rate=self.audit_rate, seed=self.settings.seed,
                           tracer=tracer)  # fmt: skip


def top_k_of(model_dir: str) -> int:
    """Experts per token of a checkpoint (1 when its config does not say; also when there is no readable
    config, which the engine then refuses with the reason before the controller is consulted)."""
    try:
        cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return 1
    return int(cfg.get("num_experts_per_tok") or 1) if isinstance(cfg, dict) else 1


def run_settings(policy: Policy, overrides: Overrides) -> RunSettings:
    """The run settings of a (merged) policy and the caller's overrides."""
    mem = policy.memory
    stacked = overrides.is_stacked_when_fits
    return RunSettings(
        model_dir=policy.model or str(CHECKPOINT_DIR),
        max_new_tokens=overrides.max_new_tokens,
        seed=overrides.seed,
        temperature=overrides.temperature,
        device_budget_mb=mem.device_budget_mb,
        host_budget_mb=mem.host_budget_mb,
        spill_dir=mem.spill_dir,
        block_size=mem.block_size,
        max_num_seqs=mem.max_num_seqs,
        profile=policy.hardware.profile,
        preempt_mode=mem.preempt_mode,
        max_num_batched_tokens=overrides.max_num_batched_tokens,
        dtype=overrides.dtype,
        is_stacked_when_fits=not overrides.force if stacked is None else stacked,
        num_io_threads=overrides.num_io_threads,
        audit_cache_mb=overrides.audit_cache_mb,
    )


_ENGINE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
"""EngineConfig's defaults, for the overrides whose None means "the engine's default"."""


def _max_model_len(policy: Policy, overrides: Overrides) -> int:
    """Tokens per request: the caller's exact override, else the policy's, else the engine's default (the engine
    caps it by the model's positions)."""
    if overrides.max_model_len is not None:
        return overrides.max_model_len
    if policy.memory.max_model_len is not None:
        return policy.memory.max_model_len
    return int(_ENGINE_DEFAULTS["max_model_len"])


def engine_config(policy: Policy, settings: RunSettings, overrides: Overrides) -> EngineConfig:
    """The engine configuration: the settings with the policy's hardware profile, low-bit copies and mode."""

    def to_bytes(exact: int | None, mb: float | None) -> int | None:
        if exact is not None:
            return exact
        return None if mb is None else int(mb * MIB)

    return EngineConfig(
        model_dir=settings.model_dir,
        device_budget_bytes=to_bytes(overrides.device_budget_bytes, settings.device_budget_mb),
        host_budget_bytes=to_bytes(overrides.host_budget_bytes, settings.host_budget_mb),
        spill_dir=settings.spill_dir,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=_max_model_len(policy, overrides),
        preempt_mode=settings.preempt_mode,
        expert_lowbit_bits=policy.controller.expert_lowbit_bits,
        profile=hardware_profile(policy),
        seed=settings.seed,
        dtype=settings.dtype,
        is_stacked_when_fits=settings.is_stacked_when_fits,
        num_io_threads=settings.num_io_threads,
        audit_cache_bytes=int(settings.audit_cache_mb * MIB),
        is_observe=policy.audit.mode == AuditMode.OBSERVE,
        device=_ENGINE_DEFAULTS["device"] if overrides.device is None else overrides.device,
        is_emulated_device_tier=overrides.is_emulated_device_tier,
        is_decode_compiled=policy.hardware.compile_decode,
        is_prefix_reused=policy.memory.prefix_reuse,
        prefix_ram_cap_bytes=int(policy.memory.prefix_cache_mb * MIB),
        lowbit_cache_dir=os.path.expanduser(policy.memory.lowbit_dir) if policy.memory.lowbit_dir else None,
        is_lowbit_prepared=policy.memory.lowbit_dir is not None,
    )


def fold_host_into_ram(
    device: float | None, host: float | None, device_name: str = "auto"
) -> tuple[float | None, float | None]:
    """A caller's (device, host) budgets (any unit; None: unset) as the engine on `device_name` takes them:
    unchanged on CUDA; on a CPU, where RAM is the one fast tier and there is no host tier, one RAM budget
    holding what both held (benchmarks written for the CUDA layout run honestly on a CPU)."""
    if resolve_device(device_name).type != "cpu":
        return device, host
    if not host:
        return device, None
    return (None if device is None else device + host), None


CPU_EXECUTE_REFUSED = (
    "cpu_execute is not offered where the device is the CPU: RAM is the only fast tier, so an expert computes "
    "where it is (resident) or is read from disk (exact_load); there is no host copy to compute from"
)


def check_device_tags(
    policy: Policy, force: tuple[str, ...], config: EngineConfig, policy_name: str | None = None
) -> None:
    """Refuse cpu_execute (a policy class allowing it, or forced) where the device is the CPU."""
    if resolve_device(config.device).type != "cpu" or config.is_emulated_device_tier:
        return
    if Tag.CPU_EXECUTE.value in force:
        raise PolicyError("--force", [f"cpu_execute: {CPU_EXECUTE_REFUSED}"])
    named = [name for name, cls in policy.classes.items() if Tag.CPU_EXECUTE.value in cls.budget.allowed_tags]
    if named:
        raise PolicyError(
            f"policy {policy_name}" if policy_name else "policy",
            [f"classes.{name}.budget.allowed_tags: {CPU_EXECUTE_REFUSED}; remove it on this machine" for name in named],
        )


def controller_settings(
    policy: Policy, model_dir: str, overrides: Overrides, calibration: Ledger | None
) -> ControllerSettings:
    """What the policy's controller is built from; the joint controller's costs come from ``calibration``."""
    spec = policy.controller
    cost = None
    if spec.kind == ControllerKind.JOINT:
        bits = spec.expert_lowbit_bits or 8
        cost = load_calibration(calibration, bits) if calibration is not None else CostModel(lowbit_bits=bits)
    fraction = overrides.expert_fraction
    return ControllerSettings(
        kind=spec.kind,
        spec=spec,
        force=tuple(overrides.force),
        top_k=top_k_of(model_dir),
        expert_fraction=spec.expert_fraction if fraction is None else fraction,
        is_equivalent_allowed=overrides.is_equivalent_allowed,
        cost_model=cost,
    )


def build_controller(policy: Policy, settings: ControllerSettings) -> Controller:
    """The controller ``settings`` describe (forced tags act only on exact_lru)."""
    if settings.force:
        if settings.kind != ControllerKind.EXACT_LRU:
            raise ValueError(
                f"force={list(settings.force)} needs an exact_lru policy, not controller {settings.kind!r}"
            )
        return ExactLRUController(settings.force, kv_quant_bits=settings.spec.kv_quant_bits)
    return make_controller(
        settings.kind,
        policy,
        cost_model=settings.cost_model,
        top_k=settings.top_k,
        expert_fraction=settings.expert_fraction,
        is_equivalent_allowed=settings.is_equivalent_allowed,
    )


def assemble(
    policy: Policy | None = None,
    overrides: Overrides | None = None,
    *,
    policy_name: str | None = None,
    calibration: Ledger | None = None,
) -> Assembly:
    """Build the engine a policy (None: :func:`no_policy`) and overrides describe.

    ``policy_name`` names the policy file (None: no file, so no declared request classes and no policy on
    the run row); ``calibration`` is a ledger whose fitted costs the joint controller predicts with.
    Raises CheckpointError for a model without a tokenizer (text prompts need one).
    """
    policy = policy or no_policy()
    overrides = overrides or Overrides()
    settings = run_settings(policy, overrides)
    config = engine_config(policy, settings, overrides)
    check_device_tags(policy, tuple(overrides.force), config, policy_name)
    ctrl = controller_settings(policy, settings.model_dir, overrides, calibration)
    controller = build_controller(policy, ctrl)
    if overrides.wrap_controller is not None:
        controller = overrides.wrap_controller(controller)
    engine = Engine(config, controller)
    if engine.tokenizer is None:
        engine.close()
        raise CheckpointError(f"{settings.model_dir}: no tokenizer files next to the weights; text prompts need one")
    declared = policy_name is not None
    classes = RequestClasses(
        budgets=class_budgets(policy) if declared else {},
        slos=class_slos(policy) if declared else {},
        default=policy.default_class,
    )
    return Assembly(
        policy=policy,
        policy_name=policy_name,
        settings=settings,
        engine_config=config,
        controller_settings=ctrl,
        engine=engine,
        classes=classes,
        trace_dir=overrides.trace_dir,
    )
