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

The section is part of the policy schema (``fallbackgate.policy.schema.ParitySpec``), so ``fallbackgate
policy check`` validates it like every other section; this module reads it for parity runs.
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml
from pydantic import ValidationError

from fallbackgate.policy import Policy, PolicyError, parse_policy
from fallbackgate.policy.loader import format_errors

__all__ = ["ParitySpec", "TaskTolerance", "load_parity_policy", "parse_parity_policy"]
from fallbackgate.policy.schema import ParitySpec, TaskTolerance


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
