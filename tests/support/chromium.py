"""A real headless Chromium for tests, driven over the DevTools protocol (CDP).

Debian's ``chromium`` is started with ``--remote-debugging-port=0``; the port it chose is read
from ``DevToolsActivePort`` in its profile directory, and one page is driven over that
page's WebSocket (``websockets``' synchronous client). Every call has a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SKIP_REASON = (
    "Debian's chromium is not installed (scripts/system-deps.sh installs it): the status "
    "page is tested in a real browser"
)


class CdpError(RuntimeError):
    pass


class Chromium:
    def __init__(self, profile: Path, timeout_s: float = 30.0) -> None:
        if CHROMIUM is None:
            raise RuntimeError(SKIP_REASON)
        self.profile = profile
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: ClientConnection | None = None
        self._id = 0
        self._stack = contextlib.ExitStack()

    def start(self) -> Chromium:
        assert CHROMIUM is not None
        self.profile.mkdir(parents=True, exist_ok=True)
        cmd = [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--mute-audio",
            "--window-size=1400,900",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        log = open(self.profile / "chromium.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        log.close()
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(
                    f"chromium did not open its DevTools port within {self.timeout_s} s; "
                    f"see {self.profile / 'chromium.log'}"
                )
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=self.timeout_s).json()
        url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = self._stack.enter_context(
            connect(url, open_timeout=self.timeout_s, max_size=64 * 1024 * 1024)
        )
        self.call("Page.enable")
        self.call("Runtime.enable")
        return self

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; events before it are dropped."""
        assert self.ws is not None
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"CDP {method} did not answer within {self.timeout_s} s")
            message = json.loads(self.ws.recv(timeout=left))
            if message.get("id") == self._id:
                if "error" in message:
                    raise CdpError(f"CDP {method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        answer = self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=await_promise,
        )
        if "exceptionDetails" in answer:
            raise CdpError(f"{expression[:80]!r} threw: {answer['exceptionDetails']}")
        return answer["result"].get("value")

    def wait_for(self, condition: str, timeout_s: float | None = None) -> None:
        """Poll a JavaScript condition until it is true, within a deadline."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{condition!r} stayed false for {limit} s")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path

    def close(self) -> None:
        """Ends the browser (it keeps nothing worth a graceful stop)."""
        self.ws = None
        self._stack.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@contextlib.contextmanager
def chromium(profile: Path, timeout_s: float = 30.0) -> Iterator[Chromium]:
    """A started browser, closed on the way out (also when starting it fails)."""
    browser = Chromium(profile, timeout_s)
    try:
        yield browser.start()
    finally:
        browser.close()
