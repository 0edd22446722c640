"""python -m fallbackgate.bench.kv_staging --json bench-kv-staging.json

Per-step cost of per-layer KV staging: one request on the bundled model whose KV is `--ratio` times the
budget's KV room (device budget = the expert floor + KV / ratio, no host tier: off-device blocks are on
disk), against the same request with everything in RAM (experts one by one, as under a budget). Per step:
wall time, the time spent laying out per-layer K/V (reads included), the KV blocks read and their bytes as
the tags report them, the spill's own read/write counters, and this process's /proc/self/io counters
(rchar/wchar: every read/write call, page cache included; read_bytes/write_bytes: storage only). The
capped run's expert reads from the checkpoint are in the same counters (its budget holds two experts).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.sweep.measures import proc_io
from fallbackgate.tinymoe import CHECKPOINT_DIR


def _steps(engine: Engine) -> list[dict[str, object]]:
    rows, spill = [], engine.kv_store.spill
    while engine.has_unfinished():
        engine.runner.layer_staging_s = 0.0
        before, read0, written0 = proc_io(), spill.num_read_bytes, spill.num_written_bytes
        started = time.perf_counter()
        result = engine.step()
        wall = time.perf_counter() - started
        after = proc_io()
        loads = [e for e in result.events if e.object_kind is ObjectKind.KV_BLOCK and e.tag is Tag.EXACT_LOAD]
        row: dict[str, object] = {"kind": result.kind.value, "is_layer_staged": engine.scheduler.is_layer_staged}
        row.update(wall_s=wall, layer_staging_s=engine.runner.layer_staging_s)
        row.update(kv_blocks_loaded=sum(e.count for e in loads), kv_bytes_tagged=sum(e.bytes_moved for e in loads))
        row.update(spill_read=spill.num_read_bytes - read0, spill_written=spill.num_written_bytes - written0)
        row.update({key: after[key] - before[key] for key in ("rchar", "wchar", "read_bytes", "write_bytes")})
        rows.append(row)
    return rows


def run(prompt_tokens: int, new_tokens: int, ratio: float, spill_dir: str) -> dict[str, object]:
    """Both runs and the medians of their decode steps."""
    prompt = [(i * 37) % 4000 + 5 for i in range(prompt_tokens)]
    params = SamplingParams(max_new_tokens=new_tokens)
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), max_num_seqs=1, is_stacked_when_fits=False)
    ref = Engine(config, ExactLRUController())
    ref.add_request(prompt, params, "r")
    ref_rows = _steps(ref)
    ref_tokens, kv, expert = ref.finished["r"].output_token_ids, ref.kv_store, ref.expert_store.bytes_per_expert
    ref.close()
    kv_bytes = -(-(prompt_tokens + new_tokens) // kv.block_size) * kv.num_layers * kv.bytes_per_block
    floor = 2 * expert
    budget = floor + int(kv_bytes / ratio)
    capped = EngineConfig(
        model_dir=str(CHECKPOINT_DIR),
        max_num_seqs=1,
        device_budget_bytes=budget,
        host_budget_bytes=0,
        spill_dir=spill_dir,
    )
    engine = Engine(capped, ExactLRUController())
    engine.add_request(prompt, params, "big")
    rows = _steps(engine)
    pool, spill = engine.kv_store.device_pool, engine.kv_store.spill
    summary = {
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "kv_bytes": kv_bytes,
        "kv_room_bytes": budget - floor,
        "budget_bytes": budget,
        "peak_pool_bytes": pool.peak_used_bytes,
        "peak_kv_staged_bytes": pool.peak_bytes_by_kind[Scratch.KV_STAGED],
        "tokens_equal": engine.finished["big"].output_token_ids == ref_tokens,
        "spill_files": len(spill.paths),
        "spill_file_bytes": spill.num_file_bytes,
    }
    engine.close()
    decode = [r for r in rows if r["kind"] == "decode"]
    medians = {key: statistics.median(float(r[key]) for r in decode) for key in decode[0] if key != "kind"}
    ref_decode = [float(r["wall_s"]) for r in ref_rows if r["kind"] == "decode"]
    summary.update(decode_median=medians, all_in_ram_decode_wall_s=statistics.median(ref_decode), steps=rows)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the summary and writes every step with ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=900)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=4.0, help="request KV / the budget's KV room")
    parser.add_argument("--spill-dir", default=tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    result = run(args.prompt_tokens, args.new_tokens, args.ratio, args.spill_dir)
    shown = {k: v for k, v in result.items() if k != "steps"}
    print(json.dumps(shown, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
