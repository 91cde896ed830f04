"""Open a report in headless Chromium over the DevTools protocol (``--remote-debugging-pipe``, stdlib only).

Used by the browser tests and to make documentation screenshots: load a file:// page, wait until the page
script says every plot rendered, collect console errors, uncaught exceptions and network requests, count
plotly's SVGs per plot div, and save a full-page PNG.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plate_inspect.errors import BrowserError

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--mute-audio",
]


def find_chromium() -> str | None:
    """Path of a Chromium binary: $CHROMIUM, /usr/bin/chromium, or chromium/chromium-browser on PATH."""
    for cand in (os.environ.get("CHROMIUM"), "/usr/bin/chromium"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CDPPipe:
    """A minimal DevTools-protocol client over Chromium's fd 3 (commands in) / fd 4 (events out) pipe."""

    def __init__(self, chromium: str, user_data_dir: Path, extra_flags: list[str] | None = None) -> None:
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        # move the child's ends above 4 so dup2 onto 3 and 4 cannot clobber them
        hi_cmd_r, hi_res_w = (os.dup2(fd, 100 + i, inheritable=False) for i, fd in enumerate((cmd_r, res_w)))
        os.close(cmd_r)
        os.close(res_w)

        def child_fds() -> None:
            os.dup2(hi_cmd_r, 3)
            os.dup2(hi_res_w, 4)

        args = [
            chromium,
            *CHROMIUM_FLAGS,
            *(extra_flags or []),
            f"--user-data-dir={user_data_dir}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            close_fds=False,
            preexec_fn=child_fds,  # noqa: PLW1509 - single-threaded fd setup before exec
        )
        os.close(hi_cmd_r)
        os.close(hi_res_w)
        self._w = os.fdopen(cmd_w, "wb", buffering=0)
        self._r = os.fdopen(res_r, "rb", buffering=0)
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._read_loop, daemon=True).start()
        threading.Thread(target=self._stderr_loop, daemon=True).start()

    def _read_loop(self) -> None:
        buf = b""
        while True:
            chunk = self._r.read(65536)
            if not chunk:
                break
            buf += chunk
            while b"\0" in buf:
                msg, buf = buf.split(b"\0", 1)
                data = json.loads(msg)
                if "id" in data:
                    with self._lock:
                        q = self._replies.get(data["id"])
                    if q is not None:
                        q.put(data)
                else:
                    self.events.append(data)

    def _stderr_loop(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line.decode(errors="replace").rstrip())

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Send one command and wait for its result (raises BrowserError on a protocol error or timeout)."""
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            q: queue.Queue = queue.Queue()
            self._replies[mid] = q
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        self._w.write(json.dumps(msg).encode() + b"\0")
        try:
            reply = q.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"chromium did not answer {method} within {timeout:.0f} s") from None
        if "error" in reply:
            raise BrowserError(f"chromium: {method} failed: {reply['error']}")
        return reply.get("result", {})

    def close(self) -> None:
        """Close Chromium (Browser.close, killed after 10 s if it hangs) and the pipes to it."""
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self._w, self._r):
            with contextlib.suppress(OSError):
                f.close()


@dataclass
class PageCheck:
    """What a headless Chromium saw when it loaded a report."""

    ready: bool
    report_error: str | None
    console_errors: list[str]
    exceptions: list[str]
    network_requests: list[str]  # every URL the page requested that is not file:, data: or about:
    plots: dict[str, int]  # plot div id -> number of plotly SVG roots (svg.main-svg) inside it
    title: str
    screenshot: Path | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def every_plot_rendered(self) -> bool:
        """Whether every plot div holds at least one plotly SVG (none means the page drew nothing)."""
        return bool(self.plots) and all(n > 0 for n in self.plots.values())


def open_report(
    html_path: str | os.PathLike,
    *,
    screenshot: str | os.PathLike | None = None,
    width: int = 1500,
    full_page: bool = True,
    max_height: int = 16000,
    timeout: float = 60.0,
    script: str | None = None,
) -> PageCheck:
    """Load ``html_path`` via file:// in headless Chromium and report what happened.

    ``script`` (a JS expression, may return a Promise) runs after the page is ready; its JSON value lands in
    ``details['script']``. A screenshot PNG is written when ``screenshot`` is given.
    """
    chromium = find_chromium()
    if chromium is None:
        raise BrowserError("chromium not found: install it (as root: apt-get install -y chromium) or set $CHROMIUM")
    url = Path(html_path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="plate-chromium-") as profile:
        cdp = CDPPipe(chromium, Path(profile))
        try:
            return _check(cdp, url, screenshot, width, full_page, max_height, timeout, script)
        finally:
            cdp.close()


def _check(
    cdp: CDPPipe,
    url: str,
    screenshot: str | os.PathLike | None,
    width: int,
    full_page: bool,
    max_height: int,
    timeout: float,
    script: str | None,
) -> PageCheck:
    target = cdp.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        cdp.send(f"{domain}.enable", session=session)
    cdp.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": 1000, "deviceScaleFactor": 1, "mobile": False},
        session=session,
    )
    cdp.send("Page.navigate", {"url": url}, session=session)

    def evaluate(expr: str, await_promise: bool = False) -> Any:
        res = cdp.send(
            "Runtime.evaluate",
            {"expression": expr, "returnByValue": True, "awaitPromise": await_promise},
            session=session,
            timeout=timeout,
        )
        if "exceptionDetails" in res:
            raise BrowserError(f"page script failed: {res['exceptionDetails'].get('text')}")
        return res.get("result", {}).get("value")

    deadline = time.monotonic() + timeout
    ready = False
    while time.monotonic() < deadline:
        state = evaluate("[document.readyState, window.__reportReady === true, window.__reportError || null]")
        if state and state[1]:
            ready = True
            break
        if state and state[2]:
            break
        time.sleep(0.2)
    time.sleep(0.3)  # let late console messages arrive
    details: dict[str, Any] = {}
    if script is not None and ready:
        details["script"] = evaluate(script, await_promise=True)
        time.sleep(0.3)
    plots = (
        evaluate(
            "Object.fromEntries(Array.from(document.querySelectorAll('div.plot')).map("
            "d => [d.id, d.querySelectorAll('svg.main-svg').length]))"
        )
        or {}
    )
    title = evaluate("document.title") or ""
    report_error = evaluate("window.__reportError || null")
    shot = None
    if screenshot is not None:
        shot = _screenshot(cdp, session, Path(screenshot), width, full_page, max_height, timeout)
    console_errors, exceptions, requests = _page_problems(list(cdp.events))
    return PageCheck(
        ready=ready,
        report_error=report_error,
        console_errors=console_errors,
        exceptions=exceptions,
        network_requests=requests,
        plots=plots,
        title=title,
        screenshot=shot,
        details=details,
    )


def _screenshot(
    cdp: CDPPipe, session: str, path: Path, width: int, full_page: bool, max_height: int, timeout: float
) -> Path:
    """A PNG of the page (the whole page up to ``max_height`` when ``full_page``), written to ``path``."""
    height = 1000
    if full_page:
        metrics = cdp.send("Page.getLayoutMetrics", session=session)
        height = int(min(max_height, metrics.get("cssContentSize", {}).get("height", 1000)))
        cdp.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        time.sleep(0.8)  # plotly relayouts on resize
    png = cdp.send("Page.captureScreenshot", {"format": "png"}, session=session, timeout=timeout)["data"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(png))
    return path


def _page_problems(events: list[dict[str, Any]]) -> tuple[list[str], list[str], list[str]]:
    """(console errors and warnings, uncaught exceptions, network requests) from the DevTools events."""
    console_errors: list[str] = []
    exceptions: list[str] = []
    requests: list[str] = []
    for ev in events:
        method, params = ev.get("method"), ev.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert", "warning"):
            console_errors.append(
                params["type"] + ": " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            )
        elif method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            exceptions.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") in ("error", "warning"):
            e = params["entry"]
            console_errors.append(f"{e['level']}: {e.get('text')} {e.get('url', '')}".strip())
        elif method == "Network.requestWillBeSent":
            req_url = params.get("request", {}).get("url", "")
            if not req_url.startswith(("file:", "data:", "about:", "blob:")):
                requests.append(req_url)
    return console_errors, exceptions, requests
