"""The replay reads each KV block in the version the served step read: a quantized copy holds the block's
K/V as it was when the copy was written, not as a later rebuild (recompute) computed it.

A block whose positions were written by steps that read other blocks dequantized carries that
approximation in its K/V (from the second layer on); a rebuild from tokens computes it without. The engine's
rebuild lives in the step's scratch; the block's int8 copy, written before, is what a later step reads
dequantized. Before, the replay kept the rebuilt K/V and re-quantized those for the later read: the served
codes matched no re-quantization (KVCodesError), and the request failed its audit (multi-turn-s0006-t2 of
the multi-turn workload under the demo budget: 'max KL inf' vs replay at the first dequantized read after a
rebuild)."""

from __future__ import annotations

import pathlib

from fallbackgate.audit.replay_trace import CopyChange, KVActions, KVVersion, ReplayTrace, Segment, load_trace
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Decision, KVMiss
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import open_ledger
from fallbackgate.recording import record_and_judge
from tests.test_engine_exact import one_request_budget, sizes

REBUILD_STEP = 8  # a decode step well after the prompt's blocks and the first decoded block were quantized


class _RebuildOnce(ExactLRUController):
    """Forced kv_dequant (every full block leaves device as an int8 copy after each step and is read
    dequantized), except at one step, where every off-device block is rebuilt from tokens (kept nowhere)."""

    def __init__(self, rebuild_step: int) -> None:
        super().__init__(("kv_dequant",))
        self.rebuild_step = rebuild_step

    def kv_action(self, miss: KVMiss) -> Decision:
        if miss.step_id == self.rebuild_step:
            return Decision(Tag.RECOMPUTE, reason="scripted rebuild")
        return super().kv_action(miss)


def test_a_copy_written_before_a_rebuild_is_replayed_as_written(checkpoint_factory, tmp_path: pathlib.Path) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, _ = sizes(path)
    budget = one_request_budget(path, 24) + 2 * expert + layers * block  # experts miss: the rebuild pass loads some
    config = EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=budget, host_budget_bytes=0, seed=0)
    engine = Engine(config, _RebuildOnce(REBUILD_STEP))
    settings = RunSettings(model_dir=str(path), max_new_tokens=16, seed=0)
    url = str(tmp_path / "ledger.sqlite")
    recorded = record_and_judge(engine, ["once upon a time the fox"], url, settings=settings)
    engine.close()
    (output,) = recorded.outcome.outputs
    assert {"kv_dequant", "recompute"} <= set(output.tag_counts), output.tag_counts
    with open_ledger(url, read_only=True) as ledger:
        trace = load_trace(ledger, recorded.run_id, output.request_id)
    rebuilt = {(layer, b) for layer, blocks in trace.kv[REBUILD_STEP].rebuilt.items() for b in blocks}
    later = [s.step_id for s in trace.segments if s.step_id > REBUILD_STEP]
    versions = trace.read_versions(config.block_size)[later[0]]
    read_as_written = {
        (layer, b) for layer, blocks in versions.items() for b, v in blocks.items() if v == KVVersion(8, None)
    }
    assert rebuilt & read_as_written, (rebuilt, versions)  # the scenario: copies older than the rebuild read
    (verdict,) = recorded.verdict.requests
    assert verdict.correctness_passed and not verdict.reasons, verdict.reasons


def test_a_copy_written_while_the_request_waited_keeps_the_version_it_had_then() -> None:
    """A block rebuilt at step 3 and kept, its int8 copy written at step 5 while the request was swapped out
    (no step row of its own), the block rebuilt again at 7, then the copy read at 8: step 8 reads the copy as
    the block was at 5 (the step-3 rebuild), not as the step-7 rebuild left it. Before, a copy written in a
    step the request did not run in was missed and read as the latest rebuild (the served codes then matched
    no re-quantization: 6 of 32 requests of the mixed workload failed their audit)."""
    segments = [Segment(s, p, 1, True) for s, p in ((1, 4), (2, 5), (3, 6), (4, 7), (7, 8), (8, 9))]
    kv = {3: KVActions(rebuilt={0: {0}}), 7: KVActions(rebuilt={0: {0}}), 8: KVActions(dequantized={0: {0: 8}})}
    written, read = CopyAction.WRITTEN.value, CopyAction.READ.value
    changes = [CopyChange(5, written, 0, 0, "disk", 8), CopyChange(8, read, 0, 0, "disk", 8)]
    trace = ReplayTrace("r", list(range(10)), 4, segments, {}, kv, copy_changes=changes)
    versions = trace.read_versions(4)
    assert versions[4][0][0] == KVVersion(0, 3)  # on device: the step-3 rebuild
    assert versions[7][0][0] == KVVersion(0, 7)
    assert versions[8][0][0] == KVVersion(8, 3)  # the copy, as written at step 5
