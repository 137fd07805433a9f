"""A headless Chromium for tests, driven over the DevTools protocol on a pipe.

`--remote-debugging-pipe` makes the browser read protocol commands from its fd 3 and write
answers to its fd 4, each message JSON ended by a NUL byte: no driver binary to match to the
browser's version, no port, no Python package. Only what the tests need: open a page, evaluate
an expression, wait until one is true, take a screenshot.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("no headless browser found (looked for $KVFLOW_BROWSER, then " + ", ".join(BROWSERS) + "): install "
                "Debian's chromium (`sudo apt-get install chromium`; ./scripts/setup.sh does it when run as root)")

# Runs in the browser's process before it becomes the browser: our pipe ends become its fds 3
# and 4 (moved above 10 first, so that neither overwrites the other), and the kernel kills it
# if the test process dies.
_EXEC_WITH_PIPES = """
import ctypes, fcntl, os, sys
read_end, write_end = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3])
os.dup2(read_end, 3)
os.dup2(write_end, 4)
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
os.execv(sys.argv[3], sys.argv[3:])
"""


class BrowserError(RuntimeError):
    pass


def find_browser() -> str | None:
    named = os.environ.get("KVFLOW_BROWSER")
    if named:
        return shutil.which(named)
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


class Browser:
    def __init__(self, binary: str, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="kvflow-browser-")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        flags = ["--headless", "--remote-debugging-pipe", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
                 "--disable-background-networking", "--mute-audio", f"--user-data-dir={self._profile.name}",
                 f"--window-size={width},{height}"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PIPES, str(to_browser_read), str(from_browser_write), binary, *flags,
             "about:blank"],
            pass_fds=(to_browser_read, from_browser_write), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._ids = itertools.count(1)
        self._buffer = b""

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        """Send one command and wait for its answer (events on the way are dropped)."""
        message_id = next(self._ids)
        message = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data):]
        deadline = time.monotonic() + timeout
        while True:
            answer = self._next_message(deadline)
            if answer.get("id") == message_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def _next_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise BrowserError("the browser did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise BrowserError(f"the browser closed its pipe (exit status {self._proc.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def new_page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.call("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        page.call("Page.enable")
        return page

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (BrowserError, OSError):
            pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        os.close(self._to_browser)
        os.close(self._from_browser)
        self._profile.cleanup()


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def call(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        return self.browser.call(method, params, self.session, timeout)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'", timeout=60)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, interval: float = 0.1):
        """Evaluate until the value is truthy; returns it. BrowserError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(interval)

    def screenshot(self, path: Path) -> bytes:
        """The whole page as PNG, written to `path`."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": self.browser.width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        data = base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"})["data"])
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": self.browser.width, "height": self.browser.height, "deviceScaleFactor": 1, "mobile": False})
        path.write_bytes(data)
        return data
