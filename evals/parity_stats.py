"""Item-by-item comparison of two lm-eval runs of one task: scores, paired bootstrap, McNemar, agreement.

Per-item values come from lm-eval's logged samples (``results["samples"][task]``), joined on ``doc_id``.
The task's primary metric is ``acc`` (multiple choice), ``word_perplexity`` (rolling log-likelihood),
``exact_match`` (generation), else the first metric the task reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PRIMARY = {"multiple_choice": "acc", "loglikelihood_rolling": "word_perplexity", "generate_until": "exact_match"}
PERPLEXITIES = ("word_perplexity", "byte_perplexity")
AGREE_RTOL = 1e-6  # rolling log-likelihoods agree when equal to this relative tolerance


@dataclasses.dataclass(slots=True)
class TaskItems:
    """One run's per-item values for a task's primary metric, in doc_id order."""

    metric: str  # primary metric name
    filter: str  # lm-eval filter the metric was computed under
    higher_is_better: bool
    doc_ids: list[int]
    values: list[Any]  # per-item metric value: 0/1, float, or (loglik, weight) for perplexities
    predictions: list[Any]  # what "the same result" compares: chosen index, text, or log-likelihood


def _primary(result: dict[str, Any], output_type: str) -> tuple[str, str]:
    keys = [k for k in result if "," in k and "_stderr" not in k]
    wanted = PRIMARY.get(output_type)
    for key in keys:
        if key.split(",")[0] == wanted:
            return wanted, key.split(",", 1)[1]
    if not keys:
        raise ValueError("the task reported no metric")
    metric, filt = keys[0].split(",", 1)
    return metric, filt


def _prediction(sample: dict[str, Any], output_type: str) -> Any:
    resps = sample["filtered_resps"]
    if output_type == "multiple_choice":
        return int(np.argmax([float(r[0]) for r in resps]))
    if output_type == "loglikelihood_rolling":
        return float(resps[0] if not isinstance(resps[0], list | tuple) else resps[0][0])
    return resps[0] if isinstance(resps, list) and len(resps) == 1 else repr(resps)


def task_items(results: dict[str, Any], task: str) -> TaskItems:
    """Per-item values of `task`'s primary metric from a ``simple_evaluate(..., log_samples=True)`` result."""
    output_type = results["configs"][task].get("output_type", "")
    metric, filt = _primary(results["results"][task], output_type)
    higher = bool(results.get("higher_is_better", {}).get(task, {}).get(metric, metric not in PERPLEXITIES))
    samples = sorted((s for s in results["samples"][task] if s.get("filter", filt) == filt), key=lambda s: s["doc_id"])
    return TaskItems(
        metric,
        filt,
        higher,
        [int(s["doc_id"]) for s in samples],
        [s[metric] for s in samples],
        [_prediction(s, output_type) for s in samples],
    )


def aggregate(metric: str, values: Sequence[Any]) -> float:
    """The corpus-level score: weighted perplexity for (loglik, weight) items, bits per byte, else the mean."""
    if values and isinstance(values[0], list | tuple):
        ll = sum(float(v[0]) for v in values)
        weight = sum(float(v[1]) for v in values)
        if metric == "bits_per_byte":
            return -ll / weight / math.log(2)
        return math.exp(-ll / weight)
    return float(np.mean([float(v) for v in values]))


def _agree(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= AGREE_RTOL * max(1.0, abs(a))
    return a == b


def paired_bootstrap(
    metric: str, exact: Sequence[Any], policy: Sequence[Any], samples: int, confidence: float, seed: int = 0
) -> tuple[float, float]:
    """Percentile interval of score(policy) − score(exact) over items resampled in pairs."""
    n = len(exact)
    rng = np.random.default_rng(seed)
    if exact and isinstance(exact[0], list | tuple):
        e = np.array([[float(v[0]), float(v[1])] for v in exact])
        p = np.array([[float(v[0]), float(v[1])] for v in policy])
        idx = rng.integers(0, n, size=(samples, n))
        se, sp = e[idx].sum(axis=1), p[idx].sum(axis=1)
        if metric == "bits_per_byte":
            diffs = (-sp[:, 0] / sp[:, 1] + se[:, 0] / se[:, 1]) / math.log(2)
        else:
            diffs = np.exp(-sp[:, 0] / sp[:, 1]) - np.exp(-se[:, 0] / se[:, 1])
    else:
        d = np.array([float(b) - float(a) for a, b in zip(exact, policy, strict=True)])
        diffs = d[rng.integers(0, n, size=(samples, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    return float(np.quantile(diffs, alpha)), float(np.quantile(diffs, 1 - alpha))


def mcnemar(exact: Sequence[Any], policy: Sequence[Any]) -> dict[str, float] | None:
    """Exact (binomial) McNemar test on 0/1 items: b = only exact right, c = only policy right."""
    if any(isinstance(v, list | tuple) for v in list(exact) + list(policy)):
        return None
    if not {float(v) for v in list(exact) + list(policy)} <= {0.0, 1.0}:
        return None
    b = sum(1 for a, p in zip(exact, policy, strict=True) if float(a) == 1 and float(p) == 0)
    c = sum(1 for a, p in zip(exact, policy, strict=True) if float(a) == 0 and float(p) == 1)
    n = b + c
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n if n else 1.0
    return {"only_exact_right": b, "only_policy_right": c, "p_value": min(1.0, 2 * tail)}


def compare(
    exact: TaskItems, policy: TaskItems, *, samples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> dict[str, Any]:
    """Both scores, the difference with its paired interval, McNemar, agreement and the perplexity ratio."""
    if exact.doc_ids != policy.doc_ids:
        raise ValueError(f"the two runs scored different items ({len(exact.doc_ids)} vs {len(policy.doc_ids)})")
    e_score, p_score = aggregate(exact.metric, exact.values), aggregate(policy.metric, policy.values)
    diff = p_score - e_score
    lo, hi = paired_bootstrap(exact.metric, exact.values, policy.values, samples, confidence, seed)
    agree = [_agree(a, b) for a, b in zip(exact.predictions, policy.predictions, strict=True)]
    ratio = p_score / e_score if exact.metric in PERPLEXITIES and e_score > 0 else None
    return {
        "metric": exact.metric,
        "filter": exact.filter,
        "higher_is_better": exact.higher_is_better,
        "num_items": len(exact.doc_ids),
        "exact_score": e_score,
        "policy_score": p_score,
        "difference": diff,
        "drop": -diff if exact.higher_is_better else diff,
        "ci": [lo, hi],
        "confidence": confidence,
        "mcnemar": mcnemar(exact.values, policy.values),
        "agreement": sum(agree) / len(agree) if agree else 1.0,
        "num_disagreeing": len(agree) - sum(agree),
        "disagreeing_doc_ids": [d for d, ok in zip(exact.doc_ids, agree, strict=True) if not ok][:20],
        "ppl_ratio": ratio,
    }
