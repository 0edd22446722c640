"""The policy file schema: pydantic models (unknown keys are errors) and their JSON Schema export.

A policy names the model, the hardware profile, device / host budgets, the spill directory, the
controller, audit settings, the ledger URL and the request classes, each with an SLO and a quality
budget. Quality limits are in the auditor's units: KL(exact ‖ engine) in nats per generated position.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fallbackgate.engine.config import PREEMPT_MODES, PreemptMode
from fallbackgate.engine.tags import NON_EXACT_TAGS
from fallbackgate.profiling.names import MEASURED, PROFILE_NAMES


class ControllerKind(str, enum.Enum):
    """The controllers a policy may name (each registered in :mod:`fallbackgate.controllers.registry`)."""

    JOINT = "joint"  # one device budget, link-time scheduling, budgeted fallbacks
    STATIC_SPLIT = "static_split"  # fixed expert / KV shares, LRU in each, exact only
    INDEPENDENT_LRU = "independent_lru"  # two LRU caches competing for one budget, exact only
    EXACT_LRU = "exact_lru"  # mixtral-offloading style: experts evicted first, exact only


class AuditMode(str, enum.Enum):
    """What a controller's decisions do in a run (the run row records it)."""

    OBSERVE = "observe"  # decided and recorded, the exact action served
    ENFORCE = "enforce"  # acted on


class StepTime(str, enum.Enum):
    """The step's fixed time a deadline leaves out (``controller.step_time``)."""

    MODELED = "modeled"  # the profile's predicted dense time
    MEASURED = "measured"  # the larger of that and this run's measured decode compute time (wall clock)


class ExpertAdmission(str, enum.Enum):
    """What the joint controller does with an expert miss whose exact copy would arrive in time
    (``controller.expert_admission``)."""

    EXACT = "exact"  # load the exact copy, evicting what must go
    LOWBIT_COLDER = "lowbit_colder"  # from its low-bit copy (no expert slot) when colder than its first victim
    LOWBIT_COLDER_DECODE = "lowbit_colder_decode"  # the same, but not while its request prefills (one expert at a
    # time with a dequantization costs a prefill more than the grouped exact load it replaces)


FALLBACK_TAGS: tuple[str, ...] = tuple(t.value for t in NON_EXACT_TAGS)
"""The tag names a class's ``allowed_tags`` may list: every tag that is not exact."""
CONTROLLER_KINDS: tuple[str, ...] = tuple(k.value for k in ControllerKind)
AUDIT_MODES: tuple[str, ...] = tuple(m.value for m in AuditMode)
STEP_TIMES: tuple[str, ...] = tuple(t.value for t in StepTime)
EXPERT_ADMISSIONS: tuple[str, ...] = tuple(a.value for a in ExpertAdmission)
_CLASS_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def _one_of(names: tuple[str, ...]) -> Any:
    """A ``Literal`` of `names`, in their order (the order the JSON Schema lists them in)."""
    return Literal[names]


PositiveRate = Annotated[float, Field(gt=0, description="bytes/s or FLOP/s, > 0")]
Milliseconds = Annotated[float, Field(gt=0, description="milliseconds, > 0")]
Nats = Annotated[float, Field(ge=0, description="KL divergence in nats, >= 0")]
FallbackTag = _one_of(FALLBACK_TAGS)
ControllerKindName = _one_of(CONTROLLER_KINDS)
AuditModeName = _one_of(AUDIT_MODES)
ProfileName = _one_of(PROFILE_NAMES)
PreemptModeName = _one_of(PREEMPT_MODES)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True, allow_inf_nan=False)


class HardwareSpec(_Strict):
    """The hardware profile the controller predicts with: ``measured`` (this machine, measured once and
    cached; see ``fallbackgate profile``) or a shipped what-if, with any of its rates overridden; and whether
    decode forwards run compiled (one ``torch.compile`` graph, the engine's functions inside it as operators)."""

    profile: ProfileName = MEASURED
    compile_decode: bool = False
    host_to_device_bytes_per_s: PositiveRate | None = None
    device_to_host_bytes_per_s: PositiveRate | None = None
    disk_to_host_bytes_per_s: PositiveRate | None = None
    host_to_disk_bytes_per_s: PositiveRate | None = None
    device_flops: PositiveRate | None = None
    cpu_expert_flops: PositiveRate | None = None
    link_latency_s: Annotated[float, Field(ge=0)] | None = None

    def overrides(self) -> dict[str, float]:
        """The rates this spec sets explicitly."""
        return {k: v for k, v in self.model_dump(exclude={"profile", "compile_decode"}).items() if v is not None}


class MemorySpec(_Strict):
    """Device and host budgets (MiB; null: everything fits), the spill directory and paging knobs."""

    device_budget_mb: Annotated[float, Field(gt=0)] | None = None
    host_budget_mb: Annotated[float, Field(gt=0)] | None = None
    spill_dir: str | None = None
    block_size: Annotated[int, Field(ge=1, le=1024)] = 16
    max_num_seqs: Annotated[int, Field(ge=1, le=1024)] = 8
    preempt_mode: PreemptModeName = PreemptMode.SWAP.value
    # prompt + output tokens per request; null: the engine's default; either way capped by the model's positions
    max_model_len: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    # full KV blocks kept by content hash after their request and reused by later requests with that prefix
    prefix_reuse: bool = True
    # kept prefix blocks in RAM (the fast tier) at most, MiB; the least recently used are dropped beyond it
    prefix_cache_mb: Annotated[float, Field(ge=0)] = 256.0
    # CPU: every expert's low-bit copy made once before serving and kept on disk here (per checkpoint and bit
    # width, reused by later runs), so an expert_lowbit miss reads the copy, not the whole expert; null: a
    # copy is made from the checkpoint on first use and kept in RAM while room lasts; "~" is expanded
    lowbit_dir: str | None = None

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("a power of two")
        return value


class ControllerSpec(_Strict):
    """Which controller decides, and its knobs."""

    kind: ControllerKindName = ControllerKind.JOINT.value
    expert_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.5  # static_split: device share of expert slots
    routing_decay: Annotated[float, Field(gt=0, lt=1)] = 0.9  # joint: per-step decay of routing frequency
    kv_quant_bits: Literal[4, 8] = 8  # bits of quantized KV copies
    expert_lowbit_bits: Literal[0, 4, 8] = 8  # bits of low-bit expert copies (0: none)
    step_time: StepTime = StepTime.MODELED  # the step's fixed time a deadline leaves out (StepTime)
    expert_admission: ExpertAdmission = ExpertAdmission.EXACT  # joint: in-time misses (ExpertAdmission)


class AuditSpec(_Strict):
    """observe: decide and record, serve exactly; enforce: act. sample_rate: fraction audited."""

    mode: AuditModeName = AuditMode.OBSERVE.value
    sample_rate: Annotated[float, Field(gt=0, le=1)] = 1.0


class LedgerSpec(_Strict):
    """Where the run is recorded (any SQLAlchemy URL or a SQLite path)."""

    url: Annotated[str, Field(min_length=1)] | None = None


class SLO(_Strict):
    """Latency targets of a class (modeled time, milliseconds)."""

    ttft_ms: Milliseconds = 1000.0
    tpot_ms: Milliseconds = 100.0
    p99_ttft_ms: Milliseconds | None = None
    p99_tpot_ms: Milliseconds | None = None

    @model_validator(mode="after")
    def _p99_not_below_mean(self) -> SLO:
        for name in ("ttft", "tpot"):
            p99 = getattr(self, f"p99_{name}_ms")
            if p99 is not None and p99 < getattr(self, f"{name}_ms"):
                raise ValueError(f"@p99_{name}_ms: a value >= {name}_ms ({getattr(self, f'{name}_ms')})")
        return self


class QualityBudget(_Strict):
    """Per-request limits on measured (and predicted) quality loss, and the fallbacks allowed at all."""

    max_mean_kl: Nats = 1e-6  # default: exact serving, numeric noise only
    max_p99_kl: Nats = 1e-6
    min_top1_agreement: Annotated[float, Field(ge=0, le=1)] = 1.0
    max_approx_fraction: Annotated[float, Field(ge=0, le=1)] = 0.0
    allowed_tags: list[FallbackTag] = Field(default_factory=list)

    @field_validator("allowed_tags")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("tags without repeats")
        return value

    @model_validator(mode="after")
    def _p99_not_below_mean(self) -> QualityBudget:
        if self.max_p99_kl < self.max_mean_kl:
            raise ValueError(f"@max_p99_kl: a value >= max_mean_kl ({self.max_mean_kl})")
        return self

    def as_gate_dict(self) -> dict[str, Any]:
        """The budget in the form the gate and the ledger take."""
        return self.model_dump()


class RequestClass(_Strict):
    """One request class: its SLO and quality budget."""

    slo: SLO = Field(default_factory=SLO)
    budget: QualityBudget = Field(default_factory=QualityBudget)
    description: str = ""


class TaskTolerance(_Strict):
    """Tolerances of one task; None inherits the parity section's default."""

    max_score_drop: Annotated[float, Field(ge=0)] | None = None
    min_agreement: Annotated[float, Field(ge=0, le=1)] | None = None
    max_ppl_ratio: Annotated[float, Field(ge=1)] | None = None


class ParitySpec(_Strict):
    """The ``parity`` section of a policy file."""

    default: TaskTolerance = Field(
        default_factory=lambda: TaskTolerance(max_score_drop=0.0, min_agreement=1.0, max_ppl_ratio=1.0)
    )
    tasks: dict[str, TaskTolerance] = Field(default_factory=dict)
    confidence: Annotated[float, Field(gt=0, lt=1)] = 0.95
    bootstrap_samples: Annotated[int, Field(ge=100, le=100_000)] = 2000

    def for_task(self, task: str) -> TaskTolerance:
        """The task's tolerances with the default filled in (unset defaults mean exact parity)."""
        own = self.tasks.get(task, TaskTolerance())
        exact = {"max_score_drop": 0.0, "min_agreement": 1.0, "max_ppl_ratio": 1.0}
        merged = {
            k: v if v is not None else (getattr(self.default, k) if getattr(self.default, k) is not None else exact[k])
            for k, v in own.model_dump().items()
        }
        return TaskTolerance(**merged)


class Policy(_Strict):
    """A whole policy file."""

    version: Literal[1] = 1
    model: str | None = None
    hardware: HardwareSpec = Field(default_factory=HardwareSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    controller: ControllerSpec = Field(default_factory=ControllerSpec)
    audit: AuditSpec = Field(default_factory=AuditSpec)
    ledger: LedgerSpec = Field(default_factory=LedgerSpec)
    classes: dict[str, RequestClass] = Field(default_factory=lambda: {"default": RequestClass()}, min_length=1)
    default_class: str = "default"
    parity: ParitySpec | None = None  # lm-eval parity tolerances (`fallbackgate parity`); None: exact parity

    @field_validator("classes")
    @classmethod
    def _class_names(cls, value: dict[str, RequestClass]) -> dict[str, RequestClass]:
        for name in value:
            if not _CLASS_NAME.match(name):
                raise ValueError(f"class names matching {_CLASS_NAME.pattern} (got {name!r})")
        return value

    @model_validator(mode="after")
    def _default_class_exists(self) -> Policy:
        if self.default_class not in self.classes:
            raise ValueError(f"@default_class: one of the class names {sorted(self.classes)}")
        return self

    def request_class(self, name: str) -> RequestClass:
        """The class `name`, or a KeyError naming the known classes."""
        if name not in self.classes:
            raise KeyError(f"request class {name!r} is not in the policy (classes: {sorted(self.classes)})")
        return self.classes[name]


def json_schema() -> dict[str, Any]:
    """The policy's JSON Schema (draft 2020-12), for editors."""
    schema = Policy.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "fallbackgate policy"
    return schema
