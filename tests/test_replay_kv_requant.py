"""Forced kv_dequant on the bundled model: the replay re-quantizes its own K/V, which differ from the served
K/V by float rounding (other attention and MoE kernel shapes); near a rounding boundary an int8 code flips.
The replay rebuilds the served codes from the checksums the ledger recorded for each quantized copy
(``audit/kv_codes.py``), so a correct run matches its replay, and a wrong code is still caught."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.audit.kv_codes import KVCodesError
from fallbackgate.audit.replay import replay_logits
from fallbackgate.audit.replay_trace import load_trace
from fallbackgate.batch.prompts import BUILTIN_PROMPTS
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv import copies
from fallbackgate.engine.kv.codec import QuantKV, quantize_kv
from fallbackgate.ledger.db import open_ledger
from fallbackgate.recording import record_and_judge
from fallbackgate.tinymoe import CHECKPOINT_DIR

MIB = 1 << 20


@pytest.mark.slow
def test_forced_kv_dequant_run_matches_its_replay(tmp_path: pathlib.Path) -> None:
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), device_budget_bytes=3 * MIB, host_budget_bytes=0, seed=0)
    engine = Engine(config, ExactLRUController(("kv_dequant",)))
    settings = RunSettings(model_dir=str(CHECKPOINT_DIR), max_new_tokens=64, seed=0)
    recorded = record_and_judge(engine, list(BUILTIN_PROMPTS), str(tmp_path / "ledger.sqlite"), settings=settings)
    tags = {t for o in recorded.outcome.outputs for t in o.tag_counts}
    assert "kv_dequant" in tags, tags
    failed = [(v.request_id, v.reasons) for v in recorded.verdict.requests if not v.correctness_passed]
    assert not failed, failed
    with open_ledger(str(tmp_path / "ledger.sqlite"), read_only=True) as ledger:  # each replay's routing swaps
        rows = ledger.engine.connect().exec_driver_sql(
            "SELECT replay_routing_swaps FROM request_stats WHERE replay_max_kl IS NOT NULL"
        ).fetchall()
    assert rows and all(n is not None and n >= 0 for (n,) in rows), rows


@pytest.mark.slow
def test_a_planted_wrong_kv_code_fails_the_replay(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A codec bug that writes one key code two steps off (in every quantized copy the KV store makes) is
    caught: the served codes match no re-quantization of the replay's K/V."""

    def planted(block: torch.Tensor, bits: int, key_dim: int) -> QuantKV:
        quant = quantize_kv(block, bits, key_dim)
        assert quant.keys is not None
        if bits == 8:
            quant.keys.codes.view(-1)[5] ^= 2  # int8: one code per byte
        return quant

    monkeypatch.setattr(copies, "quantize_kv", planted)
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), device_budget_bytes=3 * MIB, host_budget_bytes=0, seed=0)
    engine = Engine(config, ExactLRUController(("kv_dequant",)))
    settings = RunSettings(model_dir=str(CHECKPOINT_DIR), max_new_tokens=64, seed=0)
    recorded = record_and_judge(engine, list(BUILTIN_PROMPTS), str(tmp_path / "ledger.sqlite"), settings=settings)
    assert "kv_dequant" in {t for o in recorded.outcome.outputs for t in o.tag_counts}
    failed = [v.request_id for v in recorded.verdict.requests if not v.correctness_passed]
    assert failed, "the planted code went unnoticed"
    with open_ledger(str(tmp_path / "ledger.sqlite"), read_only=True) as ledger:  # why: the replay's own error
        trace = load_trace(ledger, recorded.run_id, failed[0])
        with pytest.raises(KVCodesError, match="are not a re-quantization of the replay's K/V"):
            list(replay_logits(engine, trace))
