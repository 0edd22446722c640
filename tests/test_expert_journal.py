"""The expert store's residency journal and what follows it: the joint controller's expert ranking and the
copy verifier's copy list agree, at every call of a real engine run, with full walks of every expert; the
scaled frequencies are the decayed ones; the change log tells a reader that fell behind to rebuild."""

from __future__ import annotations

import random

import pytest

from fallbackgate.bench import victims_reference as ref
from fallbackgate.controllers import JointController
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.journal import MIN_KEPT, ChangeLog
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.policy.schema import Policy
from tests.test_controllers_engine import SLOW
from tests.test_engine_exact import sizes


def test_a_reader_that_fell_behind_is_told_to_rebuild() -> None:
    log: ChangeLog[int] = ChangeLog()
    assert log.since(-1) == (None, 0)
    for i in range(3):
        log.record(i)
    assert log.since(1) == ([1, 2], 3) and log.since(3) == ([], 3)
    for i in range(3, MIN_KEPT + 1):  # one past the bound: the oldest half goes
        log.record(i)
    assert log.since(0)[0] is None
    changed, cursor = log.since(MIN_KEPT)
    assert changed == [MIN_KEPT] and cursor == MIN_KEPT + 1


@pytest.mark.parametrize("seed", range(5))
def test_scaled_frequencies_are_the_decayed_ones(seed: int) -> None:
    """Against decaying every frequency each step (the former update, kept in victims_reference), through
    uses, prunes and one renormalization of the shared scale."""
    rng, model, plain = random.Random(seed), ValueModel(0.5), {}
    keys = [(0, e) for e in range(12)]

    class _Uses:
        used_expert_keys: tuple = ()
        deferred_expert_keys: tuple = ()

    view = _Uses()
    for step in range(600):  # 0.5 ** 600 < 1e-150: the scale is folded back in on the way
        view.used_expert_keys = tuple(k for k in keys if rng.random() < (0.3 if step < 300 else 0.02))
        model.update(view)  # type: ignore[arg-type]
        ref.decay_walk(plain, model.decay, set(view.used_expert_keys))
        got = dict(model.frequencies())
        assert got.keys() == plain.keys(), step
        assert all(abs(got[k] - f) <= 1e-12 * f for k, f in plain.items()), step
    assert model.epoch >= 1


class CheckedJoint(JointController):
    """The joint controller, checking its maintained structures against full walks at every call."""

    def __init__(self, engine_ref: list[Engine], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engine_ref, self.num_checked = engine_ref, 0

    def _check(self, view) -> None:
        self.ranking.sync(view, self.values)
        got = [key for _, key in self.ranking.victims(view, self.values)]
        assert got == ref.joint_expert_victims(self.values, view, set(), len(got) + 1)
        ranking = self.ranking  # stale entries (a walk pops them first: lower frequencies) stay few
        assert ranking.num_entries == sum(map(len, ranking.heaps.values())) <= 2 * len(ranking.live) + 8
        for key in view.device_expert_keys():  # the remembered load times are the profile's
            assert (
                self.values.expert_value(key, view)
                == self.values.frequency(key)
                * view.profile.transfer_s(view.bytes_per_expert, view.expert_home(key))
                / view.bytes_per_expert
            )
        verifier = self.engine_ref[0].verifier
        assert verifier._copies() == ref.copies_walk(self.engine_ref[0].expert_store.entries)
        self.num_checked += 1

    def choose_victims(self, num_bytes, view, pinned_experts, pinned_kv):
        self._check(view)
        return super().choose_victims(num_bytes, view, pinned_experts, pinned_kv)

    def on_step_end(self, view):
        actions = super().on_step_end(view)
        self._check(view)
        return actions


@pytest.mark.parametrize("is_emulated", [False, True])  # CPU: RAM and disk; emulated: host copies too
def test_the_ranking_and_the_copy_list_follow_a_real_run(checkpoint_factory, is_emulated: bool) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    engine_ref: list[Engine] = []
    controller = CheckedJoint(engine_ref, Policy(), top_k=top_k)
    config = EngineConfig(
        model_dir=str(path), block_size=4, max_num_seqs=3, device_budget_bytes=5 * expert + 10 * layers * block,
        host_budget_bytes=6 * expert if is_emulated else 0, profile=SLOW, is_emulated_device_tier=is_emulated,
    )  # fmt: skip
    engine = Engine(config, controller)
    engine_ref.append(engine)
    rng = random.Random(0)
    for i in range(4):
        engine.add_request([rng.randrange(3, 300) for _ in range(9)], SamplingParams(max_new_tokens=6), f"r{i}")
    evicted = 0
    while engine.has_unfinished():
        before = set(engine.expert_store.device_keys())
        engine.step()
        evicted += len(before - set(engine.expert_store.device_keys()))
    engine.close()
    assert controller.num_checked > 20 and evicted > 10
    assert controller.ranking.num_rebuilds == 1  # built once, then kept from the journal
