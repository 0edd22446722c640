"""The sweep's mixed workload: short chats and long-context requests in two classes, seeded.

Long contexts are passages of ``evals/data/rolling_ppl.jsonl`` cut to ``long_tokens`` tokens; chats are
single short lines taken from other passages. Each request is put in the strict or the best-effort class
(``strict_share`` of them strict), independently of its length. ``split`` keeps two workloads disjoint:
"a" draws only even-numbered passages, "b" only odd ones, "all" any.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from typing import Any

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.engine.model.build import resolve_device
from fallbackgate.engine.tags import NON_EXACT_TAGS, Exactness, Tag
from fallbackgate.policy.schema import FALLBACK_TAGS, AuditMode, ControllerKind, ExpertAdmission, Policy, StepTime
from fallbackgate.profiling.names import MEASURED
from fallbackgate.resources import package_dir

PASSAGES = package_dir("fallbackgate.evals") / "data" / "rolling_ppl.jsonl"
STRICT, BEST_EFFORT = "strict", "best-effort"


@dataclasses.dataclass(slots=True, frozen=True)
class WorkloadSpec:
    """Shape of the mixed workload."""

    seed: int = 0
    num_chats: int = 6  # short prompts
    num_long: int = 2  # long-context prompts
    long_tokens: int = 192  # prompt tokens of a long-context request
    chat_new_tokens: int = 16  # tokens generated per chat
    long_new_tokens: int = 16  # tokens generated per long-context request
    strict_share: float = 0.5  # fraction of requests in the strict class
    split: str = "all"  # "a", "b" or "all": which passages may be drawn

    def as_dict(self) -> dict[str, Any]:
        """The spec as plain JSON-able values."""
        return dataclasses.asdict(self)


def load_passages(path: pathlib.Path = PASSAGES) -> list[str]:
    """Passage texts, in file order."""
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


def _short_line(text: str, rng: random.Random) -> str:
    lines = [ln.strip() for ln in text.splitlines() if 20 <= len(ln.strip()) <= 90]
    return rng.choice(lines) if lines else text[:80].strip()


def build_workload(spec: WorkloadSpec, tokenizer: Any) -> list[PromptSpec]:
    """The requests of ``spec``, chats and long contexts interleaved (ids ``chat-<i>`` / ``long-<i>``)."""
    if spec.split not in ("a", "b", "all"):
        raise ValueError(f"split must be 'a', 'b' or 'all', got {spec.split!r}")
    rng = random.Random(spec.seed)
    passages = load_passages()
    allowed = [i for i in range(len(passages)) if spec.split == "all" or i % 2 == (0 if spec.split == "a" else 1)]
    chosen = rng.sample(allowed, spec.num_chats + spec.num_long)
    specs: list[PromptSpec] = []
    for i, index in enumerate(chosen[: spec.num_long]):
        ids = tokenizer.encode(passages[index])[: spec.long_tokens]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cls = STRICT if rng.random() < spec.strict_share else BEST_EFFORT
        specs.append(PromptSpec(text, f"long-{i}", cls, spec.long_new_tokens))
    chats = []
    for i, index in enumerate(chosen[spec.num_long :]):
        cls = STRICT if rng.random() < spec.strict_share else BEST_EFFORT
        chats.append(PromptSpec(_short_line(passages[index], rng), f"chat-{i}", cls, spec.chat_new_tokens))
    merged: list[PromptSpec] = []
    every = max(1, len(chats) // max(1, len(specs)))
    for i, chat in enumerate(chats):  # a long request after every few chats, so both share the batch
        if i % every == 0 and specs:
            merged.append(specs.pop(0))
        merged.append(chat)
    return merged + specs


def _class_budgets(offered: list[Tag], replaced: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The two classes' budget sections with `replaced`'s fields put in (ValueError for another class)."""
    unknown = sorted(set(replaced) - {STRICT, BEST_EFFORT})
    if unknown:
        raise ValueError(f"class budgets for {unknown}: the sweep's classes are {STRICT!r} and {BEST_EFFORT!r}")
    budgets: dict[str, dict[str, Any]] = {
        STRICT: {"allowed_tags": [t.value for t in offered if t.exactness is Exactness.EQUIVALENT]},
        BEST_EFFORT: {
            "max_mean_kl": 0.05,
            "max_p99_kl": 0.3,
            "min_top1_agreement": 0.85,
            "max_approx_fraction": 0.3,
            "allowed_tags": [t.value for t in offered if t.value in FALLBACK_TAGS],
        },
    }
    for name, fields in replaced.items():
        budgets[name].update(fields)
    return budgets


def default_policy(
    tpot_ms: tuple[float, float] = (15.0, 10.0),
    ttft_ms: tuple[float, float] = (200.0, 100.0),
    profile: str = MEASURED,
    step_time: str = StepTime.MODELED.value,
    expert_admission: str = ExpertAdmission.EXACT.value,
    class_budgets: dict[str, dict[str, Any]] | None = None,
    max_num_seqs: int = 8,
) -> Policy:
    """The sweep's two classes: ``strict`` (exact and equivalent tags only: cpu_execute and recompute) and
    ``best-effort`` (every fallback, small quality budget). ``tpot_ms`` / ``ttft_ms`` are the (strict,
    best-effort) targets in measured wall clock: a decode step of the bundled model with 8 requests takes
    7-9 ms on the 2-core machine this was built on. The controller predicts with ``profile`` (this
    machine's measured one by default; ``pcie4-gpu-nvme`` is the what-if the sweep used before) and
    ``step_time`` (``controller.step_time``: what a deadline leaves out, the same for every controller);
    ``expert_admission`` is the joint controller's (``controller.expert_admission``). ``class_budgets``
    (class -> budget field -> value) replaces those fields of the two classes' quality budgets (ValueError for
    a class the sweep does not have; the policy's own validation names a bad field). ``max_num_seqs``: requests
    decoded together at most (``memory.max_num_seqs``)."""
    is_cpu = resolve_device("auto").type == "cpu"  # cpu_execute is not offered where the device is the CPU
    offered = [t for t in NON_EXACT_TAGS if not (is_cpu and t is Tag.CPU_EXECUTE)]
    budgets = _class_budgets(offered, class_budgets or {})
    return Policy.model_validate(
        {
            "hardware": {"profile": profile},
            "memory": {"block_size": 16, "max_num_seqs": max_num_seqs},
            "controller": {
                "kind": ControllerKind.JOINT.value,
                "kv_quant_bits": 8,
                "expert_lowbit_bits": 8,
                "step_time": step_time,
                "expert_admission": expert_admission,
            },
            "audit": {"mode": AuditMode.ENFORCE.value},
            "default_class": STRICT,
            "classes": {
                STRICT: {
                    "slo": {"ttft_ms": ttft_ms[0], "tpot_ms": tpot_ms[0]},
                    "budget": budgets[STRICT],
                },
                BEST_EFFORT: {
                    "slo": {"ttft_ms": ttft_ms[1], "tpot_ms": tpot_ms[1]},
                    "budget": budgets[BEST_EFFORT],
                },
            },
        }
    )
