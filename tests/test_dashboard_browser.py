"""End to end in a real browser: ``fallbackgate dashboard`` serves the app over a ledger from real engine
runs; headless Chromium (Debian's ``chromium`` package) opens every page through the Chrome DevTools
Protocol, waits until the charts are drawn and Streamlit's status widget is gone, saves a screenshot
per page (under ``$FALLBACKGATE_ARTIFACTS`` when set) and fails on any Streamlit exception element.

Skipped when /usr/bin/chromium is missing, unless FALLBACKGATE_REQUIRE_BROWSER=1 (then it fails).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_dashboard_ledger import real_ledger

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1800",
    "--remote-debugging-port=0",
)
PAGES = {"overview": 2, "pareto": 1, "compare": 1, "drift": 2, "request": 3, "calibration": 2, "sweep": 1}
STATE_JS = """(() => {
  const charts = [...document.querySelectorAll('[data-testid="stVegaLiteChart"]')];
  const drawn = charts.filter(
    c => [...c.querySelectorAll('canvas, svg')].some(e => e.getBoundingClientRect().width > 0));
  return JSON.stringify({
    charts: charts.length, drawn: drawn.length,
    status: document.querySelectorAll('[data-testid="stStatusWidget"]').length,
    exceptions: [...document.querySelectorAll('[data-testid="stException"]')].map(e => e.innerText.slice(0, 300)),
    errors: [...document.querySelectorAll('[data-testid="stAlertContentError"]')].map(e => e.innerText.slice(0, 300)),
    app: document.querySelectorAll('[data-testid="stApp"]').length,
  });
})()"""

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read()
    except OSError:
        return None


@contextlib.contextmanager
def _process(cmd: list[str], **kwargs: Any) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page target's websocket."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events received meanwhile are dropped)."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str) -> Any:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self.ws.close()


def _browser_required() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("FALLBACKGATE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{CHROMIUM} is missing and FALLBACKGATE_REQUIRE_BROWSER=1 (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium; set FALLBACKGATE_REQUIRE_BROWSER=1 to fail)")


def _sweep_json(folder: Path) -> Path:
    points = [
        {"controller": c, "expert_budget_mb": e, "kv_budget_mb": k, "mean_kl": 0.001 * (e + k), "slo_attainment": 0.9}
        for c in ("joint", "static_split")
        for e in (1, 2, 4)
        for k in (1, 2)
    ]
    path = folder / "sweep.json"
    path.write_text(json.dumps(points))
    return path


def _open_page(tools: DevTools, base: str, page: str, charts: int) -> dict[str, Any]:
    tools.call("Page.navigate", url=f"{base}/?page={page}")

    def ready() -> dict[str, Any] | None:
        state = json.loads(tools.evaluate(STATE_JS) or "{}")
        if state.get("exceptions") or state.get("errors"):
            return state  # fail fast below
        done = state.get("app") and state["drawn"] >= charts and state["status"] == 0
        return state if done else None

    state = _wait(ready, 90, f"{charts} drawn charts on page {page!r} and no status widget")
    time.sleep(0.5)  # let the last chart finish its transition before the capture
    return json.loads(tools.evaluate(STATE_JS)) | {"first": state}


def test_every_page_renders_in_chromium(tmp_path: Path) -> None:
    _browser_required()
    db = real_ledger()
    shots = Path(os.environ.get("FALLBACKGATE_ARTIFACTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, FALLBACKGATE_SWEEP_JSON=str(_sweep_json(tmp_path)))
    app_cmd = [sys.executable, "-m", "fallbackgate.cli", "dashboard", "--ledger", str(db), "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    profile = tempfile.mkdtemp(prefix="fallbackgate-chromium-", dir=tmp_path)
    with _process(app_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
        _wait(lambda: _get(f"{base}/_stcore/health") == b"ok", 60, "the dashboard's /_stcore/health")
        browser = [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"]
        with _process(browser, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL):
            active = Path(profile) / "DevToolsActivePort"
            _wait(lambda: active.exists() and active.read_text().count("\n") >= 1, 30, "Chromium's DevTools port")
            cdp_port = active.read_text().split()[0]
            targets = json.loads(_get(f"http://127.0.0.1:{cdp_port}/json/list") or b"[]")
            page_target = next(t for t in targets if t["type"] == "page")
            tools = DevTools(page_target["webSocketDebuggerUrl"])
            try:
                for page, charts in PAGES.items():
                    state = _open_page(tools, base, page, charts)
                    png = base64.b64decode(tools.call("Page.captureScreenshot", format="png")["data"])
                    shot = shots / f"dashboard-{page}.png"
                    shot.write_bytes(png)
                    print(f"screenshot {shot}: {state['drawn']} charts")
                    assert state["exceptions"] == [], f"Streamlit exception on page {page}: {state['exceptions']}"
                    assert state["errors"] == [], f"error message on page {page}: {state['errors']}"
                    assert state["drawn"] >= charts and png.startswith(b"\x89PNG") and len(png) > 10_000
            finally:
                tools.close()
