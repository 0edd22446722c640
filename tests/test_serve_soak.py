"""Soak: ``fallbackgate serve`` answers 5,000 requests of varied lengths (completions and chat, some streamed) with
a ledger and a 10 % audit sample, and its resident memory stays flat: the least-squares slope of the server
process's RSS over requests 500-5,000 is below 1 KB per request. Bounded in count and in time (it stops by
itself at its deadline and fails then); traffic to 127.0.0.1 only.

The ledger is the default kind, a SQLite file: its page cache lives in the server process and fills towards
its bound as the file grows (``ledger.db.SQLITE_CACHE_KIB`` per connection, full within the warm-up). So does the
prefix cache: kept KV blocks stay in RAM up to ``--prefix-cache-mb``; this soak states a bound the warm-up fills
(the default, 256 MiB, would take ~3,000 of these requests to fill)."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.pg_fixture import free_port

NUM_REQUESTS = 5_000
FIRST_FITTED = 500  # requests before this warm the allocator and caches up: not fitted
NUM_CLIENTS = 6
SAMPLE_EVERY = 50  # requests between RSS samples
DEADLINE_S = 600.0  # the request loop, server start excluded: bounds a hang, not speed (a loaded CI: 4,965 in 270 s)
MAX_SLOPE_BYTES = 1024.0  # per request
PREFIX_CACHE_MB = 16  # kept prefix blocks (~85 KB per request here): full within the warm-up, then recycled
WORDS = "the king said once upon a time there was a small red fox who ran far away into the dark wood".split()
MODEL = "checkpoint"


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (VmRSS of /proc/PID/status)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


def one_request(client: httpx.Client, index: int) -> None:
    """Request `index` of the soak: its kind and lengths are seeded by the index."""
    rng = random.Random(index)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    max_tokens = rng.randint(1, 12)
    is_chat, is_stream = index % 5 == 0, index % 7 == 0
    if is_chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    body |= {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice((0.0, 0.8)), "stream": is_stream}
    if is_stream:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"error"' not in lines[-2], lines[-2:]
        return
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= max_tokens


@pytest.mark.slow
def test_serve_memory_stays_flat_over_5000_requests(tmp_path: pathlib.Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "fallbackgate", "serve", "--port", str(port), "--audit-workers", "0"]
    cmd += ["--ledger", str(tmp_path / "ledger.sqlite"), "--grace-s", "5", "--prefix-cache-mb", str(PREFIX_CACHE_MB)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        up_by = time.monotonic() + 120
        while not _healthy(base):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < up_by, "server did not come up"
            time.sleep(0.2)
        samples: list[tuple[int, int]] = []
        done = [0]
        lock = threading.Lock()
        deadline = time.monotonic() + DEADLINE_S
        next_index = iter(range(NUM_REQUESTS))

        def client_loop() -> None:
            with httpx.Client(base_url=base, timeout=60) as client:
                for index in next_index:  # shared iterator: each index served once
                    if time.monotonic() > deadline:
                        return
                    one_request(client, index)
                    with lock:
                        done[0] += 1
                        if done[0] % SAMPLE_EVERY == 0:
                            samples.append((done[0], rss_bytes(proc.pid)))

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(NUM_CLIENTS) as pool:
            for future in [pool.submit(client_loop) for _ in range(NUM_CLIENTS)]:
                future.result()
        elapsed = time.monotonic() - started
        fitted = [(n, rss) for n, rss in samples if n >= FIRST_FITTED]
        per_request = slope(fitted) if len(fitted) > 1 else float("nan")
        print(
            f"\nsoak: {done[0]} requests in {elapsed:.1f} s; RSS {fitted[0][1] / 2**20:.1f} MiB at {fitted[0][0]}, "
            f"{fitted[-1][1] / 2**20:.1f} MiB at {fitted[-1][0]}; slope {per_request:.1f} bytes/request"
        )
        assert done[0] == NUM_REQUESTS, f"only {done[0]} requests answered in {DEADLINE_S:.0f} s"
        assert per_request < MAX_SLOPE_BYTES, f"RSS grows {per_request:.0f} bytes per request"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        log.close()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
