"""Two honest tiers on a CPU: RAM (the device pool) under one budget, the disk the other.

- Under a small RAM budget on the bundled model, the bytes every event says it read from disk agree with the
  kernel's count (/proc/self/io read_bytes) within 10 %: expert reads bypass the page cache (O_DIRECT), which
  would otherwise be a second, uncounted RAM tier.
- No exact_load moves zero bytes; there is no host tier (its budget is 0; a host budget is refused).
- cpu_execute is refused where the device is the CPU (policy classes, --force, --help, the store).
- Without a budget, the RAM budget is sized from the memory limit (cgroup v2 / v1 or physical RAM) minus the
  dense weights and a margin, and the summary says so.
- Tokens under a budget equal tokens with everything in RAM.
- The test-only emulation of CUDA's device/host tiers is named as such and keeps two budgets.
"""

from __future__ import annotations

import io
import pathlib

import pytest

from fallbackgate.assembly import Overrides, assemble
from fallbackgate.batch.report import print_memory
from fallbackgate.batch.session import memory_summary
from fallbackgate.cli import build_parser
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig, TierLayout
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import BudgetError, EngineError
from fallbackgate.engine.ram import MARGIN_FIXED_BYTES, MemoryLimit, memory_limit, physical_ram_bytes, size_ram_budget
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.loader import PolicyError, load_policy
from fallbackgate.sweep.measures import proc_io
from fallbackgate.tinymoe import CHECKPOINT_DIR

MIB = 1 << 20
NEW_TOKENS = 12


def _read_bytes() -> int:
    return proc_io()["read_bytes"]


def _engine(budget_bytes: int | None, **knobs: object) -> Engine:
    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR),
        device="cpu",
        device_budget_bytes=budget_bytes,
        num_io_threads=0,
        num_verified_copies_per_step=0,  # a verification re-read is real but untagged: kept out of the count
        **knobs,
    )
    return Engine(config, ExactLRUController())


def _prompts(engine: Engine) -> list[list[int]]:
    texts = ["once upon a time a princess", "the quick brown fox", "in a castle by the sea there lived"]
    return [engine.tokenizer.encode(t) for t in texts]


def _run(engine: Engine) -> tuple[list[list[int]], list, int]:
    """Tokens, events, and read_bytes measured around the steps (not the engine's construction)."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in _prompts(engine)]
    events, before = [], _read_bytes()
    while engine.has_unfinished():
        events += engine.step().events
    read = _read_bytes() - before
    return [engine.finished.pop(i).output_token_ids for i in ids], events, read


@pytest.fixture(scope="module")
def capped() -> tuple[Engine, list[list[int]], list, int]:
    engine = _engine(4 * MIB)
    tokens, events, read = _run(engine)
    yield engine, tokens, events, read
    engine.close()


def test_tagged_disk_bytes_agree_with_the_kernel_count(capped) -> None:
    engine, _, events, read = capped
    tagged = sum(e.bytes_moved for e in events if e.source_tier is Tier.DISK)
    loads = [e for e in events if e.tag is Tag.EXACT_LOAD and e.object_kind is ObjectKind.EXPERT]
    assert engine.tier_layout is TierLayout.RAM_DISK and engine.view().is_ram_tiered  # the controllers see it
    assert loads and tagged > 4 * MIB  # the budget holds ~13 of 64 experts: many are read again
    assert abs(read - tagged) <= 0.10 * tagged, (read / MIB, tagged / MIB)


def test_no_zero_byte_exact_load_and_no_host_tier(capped) -> None:
    engine, _, events, _ = capped
    loads = [e for e in events if e.tag is Tag.EXACT_LOAD and e.object_kind is ObjectKind.EXPERT]
    assert all(e.source_tier is Tier.DISK for e in loads)
    assert all(e.bytes_moved == e.count * engine.expert_store.bytes_per_expert > 0 for e in loads)
    assert engine.expert_store.host_pool.budget_bytes == 0 and engine.kv_store.host_pool.budget_bytes == 0
    assert engine.expert_store.device_pool is engine.kv_store.device_pool  # one budget for experts and KV
    assert engine.expert_store.device_pool.peak_used_bytes <= 4 * MIB


def test_tokens_under_a_budget_equal_tokens_with_everything_in_ram(capped) -> None:
    _, tokens, _, _ = capped
    roomy = _engine(None)
    try:
        assert roomy.expert_store.stacked_layers  # everything fits: every expert resident, read once
        assert _run(roomy)[0] == tokens
    finally:
        roomy.close()


def test_a_host_budget_is_refused_on_a_cpu() -> None:
    with pytest.raises(BudgetError, match="host budget .* is not offered where the device is the CPU"):
        _engine(4 * MIB, host_budget_bytes=8 * MIB)


def test_cpu_execute_is_refused_on_a_cpu(capped) -> None:
    engine = capped[0]
    with pytest.raises(EngineError, match="cpu_execute is not offered where the device is the CPU"):
        engine.expert_store.host_weights(next(iter(engine.expert_store.entries)))
    policy = load_policy(pathlib.Path(__file__).parent.parent / "fallbackgate/policies/exact.yaml")
    policy = policy.model_copy(deep=True)
    policy.classes["default"].budget.allowed_tags = ["cpu_execute"]
    with pytest.raises(PolicyError, match="classes.default.budget.allowed_tags: cpu_execute is not offered"):
        assemble(policy, Overrides(device="cpu"), policy_name="custom")
    with pytest.raises(PolicyError, match="cpu_execute is not offered"):
        assemble(None, Overrides(device="cpu", force=("cpu_execute",)))


def test_run_help_says_cpu_execute_is_not_offered_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "cpu_execute is not offered where the device is the CPU" in text
    assert "Without a GPU there is no host tier" in text


def test_memory_limit_reads_cgroup_v2_then_v1_then_physical_ram(tmp_path: pathlib.Path) -> None:
    v2, v1, missing = tmp_path / "memory.max", tmp_path / "limit_in_bytes", tmp_path / "absent"
    v2.write_text(f"{1 << 30}\n")
    assert memory_limit(v2, v1) == MemoryLimit(1 << 30, "cgroup v2 memory.max")
    v2.write_text("max\n")
    v1.write_text(f"{2 << 30}\n")
    assert memory_limit(v2, v1) == MemoryLimit(2 << 30, "cgroup v1 memory.limit_in_bytes")
    v1.write_text(f"{9223372036854771712}\n")  # an unset v1 limit: larger than RAM
    assert memory_limit(missing, v1) == MemoryLimit(physical_ram_bytes(), "physical RAM")
    assert memory_limit(missing, missing) == MemoryLimit(physical_ram_bytes(), "physical RAM")
    sized = size_ram_budget(100 * MIB, MemoryLimit(4 << 30, "cgroup v2 memory.max"))
    assert sized.margin_bytes == MARGIN_FIXED_BYTES + int(0.1 * (4 << 30))
    assert sized.budget_bytes == (4 << 30) - 100 * MIB - sized.margin_bytes
    assert size_ram_budget(8 << 30, MemoryLimit(4 << 30, "x")).budget_bytes == 0


def test_the_default_budget_is_sized_from_real_memory_and_the_summary_says_so() -> None:
    engine = _engine(None)
    try:
        expected = size_ram_budget(engine.num_dense_bytes)
        assert engine.expert_store.device_pool.budget_bytes == expected.budget_bytes
        mem = memory_summary(engine)
        assert mem["tier_layout"] == "ram_disk"
        out = io.StringIO()
        print_memory(mem, out)
        text = out.getvalue()
        assert f"sized from {memory_limit().source}" in text and "minus dense weights" in text
        assert "no host tier" in text
    finally:
        engine.close()


def test_the_summary_counts_on_disk_only_the_experts_not_resident(capped) -> None:
    """On a CPU every expert's home is the checkpoint: the ones resident in RAM are not "homed on disk"."""
    engine = capped[0]
    num_total, num_resident = len(engine.expert_store.entries), len(engine.expert_store.device_keys())
    assert 0 < num_resident < num_total  # the 4 MiB budget holds some of the experts
    mem = memory_summary(engine)
    assert mem["num_experts_on_disk"] == num_total - num_resident
    out = io.StringIO()
    print_memory(mem, out)
    assert f"{num_total - num_resident} homed on disk" in out.getvalue()


def test_the_emulated_device_tier_keeps_two_budgets_and_is_named() -> None:
    engine = _engine(4 * MIB, is_emulated_device_tier=True)
    try:
        assert engine.tier_layout is TierLayout.EMULATED_DEVICE_HOST_DISK and not engine.view().is_ram_tiered
        assert engine.expert_store.is_aliased and engine.expert_store.host_pool.budget_bytes > 0
        assert "EMULATED" in engine.budget_note
        assert memory_summary(engine)["tier_layout"] == "emulated_device_host_disk"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="emulates a device tier on a CPU"):
        EngineConfig(model_dir=str(CHECKPOINT_DIR), device="cuda", is_emulated_device_tier=True)
