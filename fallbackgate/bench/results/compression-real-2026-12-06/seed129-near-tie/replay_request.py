"""python fallbackgate/bench/results/compression-real-2026-12-06/seed129-near-tie/replay_request.py LEDGER_URL [MODEL]

One deferred run's request multi-turn-s0000-t0 (run 1 of LEDGER_URL, served with ``--audit deferred``; MODEL: the
bf16 copy, default /tmp/fg-tinymoe-bf16) against its exact baseline and against its replay, which routes as the
served forward's digests say: the statistics against each, the replay's summary (``routing_swaps``: the router
near-ties it followed), and every position's KL against each and largest logit difference from the baseline."""

import sys

from fallbackgate.audit.auditor import audit_request
from fallbackgate.engine.baseline.api import build_baseline_engine
from fallbackgate.ledger import audit_queries, audit_queue
from fallbackgate.ledger.db import open_ledger

ledger = open_ledger(sys.argv[1], read_only=True)
request_id = "multi-turn-s0000-t0"
engine = build_baseline_engine(sys.argv[2] if len(sys.argv) > 2 else "/tmp/fg-tinymoe-bf16", "bfloat16", 16)
token_ids, num_prompt = audit_queries.request_tokens(ledger, 1, request_id)
served = audit_queue.read_served(ledger, 1, request_id)
diffs, stats, replay = audit_request(
    engine, ledger, 1, request_id, token_ids[:num_prompt], token_ids[num_prompt:], served, True
)
print(stats)
print(replay)
print("position  KL vs baseline  max |dlogit|  KL vs replay")
for d in diffs:
    print(f"{d.position:8d}  {d.kl:14.3g}  {d.max_abs_dlogit:12.3g}  {d.replay_kl:12.3g}")
