"""``fallbackgate sweep --class-budgets FILE``: fields that replace the sweep's own class quality budgets,
checked before anything runs, with errors that name the file and what is wrong."""

from __future__ import annotations

import pathlib

import pytest

from fallbackgate.sweep.inputs import read_class_budgets
from fallbackgate.sweep.workload import BEST_EFFORT, STRICT, default_policy


def test_given_fields_replace_the_sweeps_and_the_rest_stay() -> None:
    base = default_policy()
    looser = default_policy(class_budgets={BEST_EFFORT: {"min_top1_agreement": 0.5, "max_mean_kl": 0.1}})
    before, after = base.classes[BEST_EFFORT].budget, looser.classes[BEST_EFFORT].budget
    assert (after.min_top1_agreement, after.max_mean_kl) == (0.5, 0.1)
    assert (after.max_p99_kl, after.max_approx_fraction, after.allowed_tags) == (
        before.max_p99_kl,
        before.max_approx_fraction,
        before.allowed_tags,
    )
    assert looser.classes[STRICT] == base.classes[STRICT]


def test_a_budget_file_is_read_and_checked(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "budgets.yaml"
    assert read_class_budgets(None) is None
    path.write_text("strict:\n  allowed_tags: [recompute, expert_lowbit]\n")
    assert read_class_budgets(path) == {STRICT: {"allowed_tags": ["recompute", "expert_lowbit"]}}
    cases = {
        "gold:\n  max_mean_kl: 0.1\n": r"class budgets for \['gold'\]",
        "best-effort:\n  max_mean_kl: -1\n": r"max_mean_kl: got -1",
        "best-effort:\n  max_kl: 0.1\n": r"max_kl: .*no such key",
        "strict:\n  allowed_tags: [exact_load]\n": r"allowed_tags",
        "- strict\n": "expected a mapping",
        "strict: [\n": "budgets.yaml",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_class_budgets(path)
    with pytest.raises(ValueError, match="missing.yaml"):
        read_class_budgets(tmp_path / "missing.yaml")
