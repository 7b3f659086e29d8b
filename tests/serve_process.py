"""A `yirage serve` started as its own process, as users start it: waiting until it answers."""
from __future__ import annotations

import contextlib
import subprocess
import time


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 300.0) -> None:
    """Poll ``base``/health until it answers 200; fails the test with the server's stderr if the
    process exits first, or after ``timeout_s`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the server did not become ready"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
