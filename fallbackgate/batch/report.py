"""What a run prints and the stable `--json` format."""

from __future__ import annotations

import json
import pathlib
from typing import Any, TextIO

from fallbackgate.batch.session import RunOutcome
from fallbackgate.engine.experts.read_ahead import TransferClock
from fallbackgate.engine.tags import TAG_EXACTNESS, Tag

JSON_FORMAT_VERSION = 1


def tag_totals(outcome: RunOutcome) -> dict[str, dict[str, int]]:
    """tag -> {"count", "bytes"} over every event of the run (requests and engine prefetches)."""
    totals = {tag.value: {"count": 0, "bytes": 0} for tag in Tag}
    for step in outcome.steps:
        for event in step.events:
            totals[event.tag.value]["count"] += event.count
            totals[event.tag.value]["bytes"] += event.bytes_moved
        resident = step.expert_resident_uses.values()  # counted on the step, not events
        totals[Tag.RESIDENT.value]["count"] += sum(sum(by_layer.values()) for by_layer in resident)
    return totals


def transfer_summary(outcome: RunOutcome) -> dict[str, Any]:
    """Measured expert disk reads over the run (see :meth:`TransferClock.summary`)."""
    total = TransferClock()
    for step in outcome.steps:
        if step.transfer is not None:
            total.add(step.transfer)
    return total.summary()


def slo_attainment(outcome: RunOutcome, slos: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Per class: requests meeting the class's TTFT and TPOT targets in measured wall clock, and the misses."""
    out: dict[str, dict[str, Any]] = {}
    for req in outcome.outputs:
        slo = (slos or {}).get(req.request_class)
        if not slo:
            continue
        targets = {"ttft_ms": slo.get("ttft_ms"), "tpot_ms": slo.get("tpot_ms")}
        entry = out.setdefault(req.request_class, {**targets, "num_requests": 0, "num_met": 0, "missed": []})
        is_ttft_ok = slo.get("ttft_ms") is None or req.ttft_s * 1e3 <= slo["ttft_ms"]
        is_tpot_ok = slo.get("tpot_ms") is None or len(req.output_token_ids) < 2 or req.tpot_s * 1e3 <= slo["tpot_ms"]
        entry["num_requests"] += 1
        entry["num_met"] += int(is_ttft_ok and is_tpot_ok)
        if not (is_ttft_ok and is_tpot_ok):
            entry["missed"].append(req.request_id)
    for entry in out.values():
        entry["attainment"] = entry["num_met"] / entry["num_requests"]
    return out


def to_json(
    outcome: RunOutcome,
    run_id: int | None,
    extra: dict[str, Any] | None = None,
    slos: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The documented `--json` document (see README, "The --json format"). Times are measured wall clock;
    ``modeled_*`` are what-if predictions of the run's hardware profile (``profile``)."""
    requests = []
    for spec, out, text in zip(outcome.specs, outcome.outputs, outcome.texts, strict=True):
        decode_s = out.finish_s - out.first_token_s
        requests.append(
            {
                "id": out.request_id,
                "class": out.request_class,
                "prompt": spec.prompt,
                "output_token_ids": out.output_token_ids,
                "text": text,
                "ttft_s": out.ttft_s,
                "tpot_s": out.tpot_s,
                "modeled_ttft_s": out.modeled_ttft_s,
                "modeled_tpot_s": out.modeled_tpot_s,
                "tokens_per_s": (len(out.output_token_ids) - 1) / decode_s if decode_s > 0 else None,
                "num_preemptions": out.num_preemptions,
                "tags": out.tag_counts,
            }
        )
    num_tokens = sum(len(o.output_token_ids) for o in outcome.outputs)
    return {
        "format_version": JSON_FORMAT_VERSION,
        "run_id": run_id,
        "requests": requests,
        "tags": tag_totals(outcome),
        "num_steps": len(outcome.steps),
        "wall_s": outcome.wall_s,
        "output_tokens_per_s": num_tokens / outcome.wall_s if outcome.wall_s > 0 else None,
        "modeled_s": sum(s.modeled_s for s in outcome.steps),
        "profile": outcome.profile_name,
        "slo_attainment": slo_attainment(outcome, slos),
        "expert_reads": transfer_summary(outcome),
        "memory": outcome.memory,
        **(extra or {}),
    }


def write_json(path: str | pathlib.Path, document: dict[str, Any]) -> None:
    pathlib.Path(path).write_text(json.dumps(document, indent=2, default=str) + "\n")


def print_slo_attainment(outcome: RunOutcome, slos: dict[str, dict[str, Any]] | None, out: TextIO) -> None:
    """One line per class with targets: requests meeting them in measured wall clock, and the misses."""
    for name, entry in slo_attainment(outcome, slos).items():
        missed = f"; missed: {', '.join(entry['missed'][:6])}" + (" ..." if len(entry["missed"]) > 6 else "")
        out.write(
            f"SLO (measured) class {name}: {entry['num_met']}/{entry['num_requests']} met TTFT <= {entry['ttft_ms']} ms"
            f" and TPOT <= {entry['tpot_ms']} ms{missed if entry['missed'] else ''}\n"
        )


def print_report(outcome: RunOutcome, out: TextIO, slos: dict[str, dict[str, Any]] | None = None) -> None:
    """Per-request speeds (measured wall clock, and the profile's modeled what-if), SLO attainment per class
    (measured) and a table of tag counts and bytes."""
    out.write(
        f"\n{'request':<14} {'class':<10} {'tokens':>6} {'tok/s':>7} {'TTFT ms':>8} {'TPOT ms':>8} "
        f"{'modeled':>9} {'modeled':>9}  text\n"
        f"{'':<14} {'':<10} {'':>6} {'':>7} {'measured':>8} {'measured':>8} {'TTFT ms':>9} {'TPOT ms':>9}\n"
    )
    for out_req, text in zip(outcome.outputs, outcome.texts, strict=True):
        n = len(out_req.output_token_ids)
        decode_s = out_req.finish_s - out_req.first_token_s
        speed = f"{(n - 1) / decode_s:7.1f}" if decode_s > 0 else "      -"
        why = outcome.failures.get(out_req.request_id)
        snippet = f"FAILED: {why}" if why is not None else text.replace("\n", " ")[:48]
        out.write(
            f"{out_req.request_id[:14]:<14} {out_req.request_class[:10]:<10} {n:>6} {speed} "
            f"{out_req.ttft_s * 1e3:8.1f} {out_req.tpot_s * 1e3:8.1f} {out_req.modeled_ttft_s * 1e3:9.3f} "
            f"{out_req.modeled_tpot_s * 1e3:9.3f}  {snippet}\n"
        )
    out.write(f"(measured: wall clock; modeled: what-if of hardware profile {outcome.profile_name!r})\n")
    print_slo_attainment(outcome, slos, out)
    mem = outcome.memory
    if mem:
        print_memory(mem, out)
    reads = transfer_summary(outcome)
    if reads["read_s"] > 0:
        share = f" ({reads['hidden_fraction']:.0%})" if reads["hidden_fraction"] is not None else ""
        predicted = (
            f"; next-layer read-ahead: {reads['num_predicted']} started, precision "
            f"{reads['prefetch_precision']:.2f}, recall {reads['prefetch_recall']:.2f}"
            if reads["prefetch_precision"] is not None
            else ""
        )
        out.write(
            f"expert disk reads (measured): {reads['read_s']:.2f} s, {reads['hidden_s']:.2f} s hidden under "
            f"compute and other reads{share}, {reads['exposed_s']:.2f} s exposed{predicted}\n"
        )
    out.write(f"\n{'tag':<14} {'exactness':<12} {'count':>10} {'MiB moved':>10}\n")
    for tag, total in tag_totals(outcome).items():
        if total["count"]:
            out.write(
                f"{tag:<14} {TAG_EXACTNESS[Tag(tag)].value:<12} {total['count']:>10} {total['bytes'] / 2**20:10.2f}\n"
            )


def print_memory(mem: dict[str, Any], out: TextIO) -> None:
    """The budgets and the peaks of the pools; on a CPU one RAM budget (no host tier)."""
    is_ram = mem.get("tier_layout") == "ram_disk"
    tier = "RAM" if is_ram else "device"
    if mem.get("budget_note"):
        out.write(f"\n{mem['budget_note']}\n")
    contents = "experts, low-bit copies, KV blocks and scratch" if is_ram else "expert slots, KV blocks and scratch"
    out.write(
        f"{tier} budget {mem['device_budget_bytes'] / 2**20:.2f} MiB for {contents} (all experts: "
        f"{mem['expert_bytes_total'] / 2**20:.2f} MiB, {mem['num_experts_on_disk']} homed on disk); dense "
        f"weights resident outside the budget: {mem['dense_bytes'] / 2**20:.2f} MiB\n"
    )
    peaks = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in mem["peak_device_pool_bytes_by_kind"].items() if v)
    line = f"peak {tier} pool {mem['peak_device_pool_bytes'] / 2**20:.2f} MiB (by kind, MiB: {peaks})"
    if is_ram:
        out.write(f"{line}; no host tier (the disk holds the checkpoint and the KV spill)\n")
        if "checkpoint_bytes_read" in mem:
            out.write(
                f"expert bytes read from the checkpoint (O_DIRECT, bypassing the page cache): "
                f"{mem['checkpoint_bytes_read'] / 2**20:.2f} MiB\n"
            )
    else:
        out.write(
            f"{line}; peak host tier {mem['peak_host_pool_bytes'] / 2**20:.2f} MiB of "
            f"{mem['host_budget_bytes'] / 2**20:.2f}\n"
        )
