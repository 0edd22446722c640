"""The GPU check compares logits only where both runs saw the same prefix."""

from __future__ import annotations

import torch

from fallbackgate.bench.gpu_check import max_dlogit_until_tokens_part


def test_logits_are_compared_up_to_and_including_the_first_step_where_tokens_part() -> None:
    ref = [torch.zeros(4, 3)]
    mine = torch.zeros(4, 3)
    mine[1, 0] = 0.25  # the step whose argmax parted: compared
    mine[2, 0] = 9.0  # after the tokens parted: a different prefix, not compared
    assert max_dlogit_until_tokens_part([[1, 2, 3, 4]], [mine], [[1, 7, 3, 4]], ref) == 0.25
    assert max_dlogit_until_tokens_part([[1, 2, 3, 4]], [mine], [[1, 2, 3, 4]], ref) == 9.0  # all steps
