"""Parity tolerances declared in a policy file, next to the policy itself.

```yaml
parity:                        # optional; without it every task must match the exact baseline exactly
  default: {max_score_drop: 0.0, min_agreement: 1.0, max_ppl_ratio: 1.0}
  tasks:
    fg_cloze: {max_score_drop: 0.05, min_agreement: 0.9}
    fg_rolling_ppl: {max_ppl_ratio: 1.02}
  confidence: 0.95             # paired-bootstrap interval level
  bootstrap_samples: 2000
```

``max_score_drop`` bounds how far the policy's primary score may fall below the exact baseline's (in the
metric's own units, sign-corrected so a drop is positive for lower-is-better metrics too);
``min_agreement`` bounds the fraction of items whose per-item result is the same; ``max_ppl_ratio``
bounds PPL(policy) / PPL(exact) for perplexity tasks. Fields left out of a task inherit ``default``.

The policy schema (``fallbackgate.policy``) forbids unknown keys; while it has no ``parity`` field, the
section is split off here and validated by :class:`ParitySpec`, and the rest by the policy schema.
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fallbackgate.policy import Policy, PolicyError, parse_policy
from fallbackgate.policy.loader import format_errors


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


def parse_parity_policy(data: Any, source: str) -> tuple[Policy, ParitySpec]:
    """Validate a parsed policy document with an optional ``parity`` section; errors name the field."""
    if not isinstance(data, dict):
        raise PolicyError(source, [f"(top level): got {type(data).__name__}; expected a mapping of policy keys"])
    data = dict(data)
    raw = data.pop("parity", None) if "parity" not in Policy.model_fields else data.get("parity")
    messages: list[str] = []
    policy: Policy | None = None
    try:
        policy = parse_policy(data, source)
    except PolicyError as exc:
        messages += exc.messages
    try:
        spec = ParitySpec.model_validate(raw or {})
    except ValidationError as exc:
        messages += [f"parity.{m}" for m in format_errors(exc)]
        spec = ParitySpec()
    if messages or policy is None:
        raise PolicyError(source, messages)
    return policy, spec


def load_parity_policy(path: str | pathlib.Path) -> tuple[Policy, ParitySpec]:
    """Read a policy file and its parity tolerances; :class:`PolicyError` lists every problem by field."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise PolicyError(str(path), ["(file): does not exist"])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(yaml)"
        raise PolicyError(str(path), [f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    return parse_parity_policy(data if data is not None else {}, str(path))
