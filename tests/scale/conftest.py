"""A local Ray instance for the scale/ tests (4 logical CPUs: 2 for the serving replicas, 2 for the
embedding job's actors, so that a worker running both never waits for CPUs; loopback only), started once per test
process and stopped (Serve, then Ray) at its end; the tests skip where Ray is not installed."""
import os
import signal
import time

import pytest


@pytest.fixture(scope="session")
def ray_local():
    """``ray``, connected to a Ray instance of this process with 4 CPUs (yirage.scale.connect)."""
    pytest.importorskip("ray", reason="the scale extra (Ray) is not installed: pip install 'yirage[scale]'")
    from yirage.scale.cluster import connect

    ray = connect("local", num_cpus=4)
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:  # noqa: BLE001 - Serve may never have started
        pass
    ray.shutdown()


def ray_worker_pids(title: str) -> list[int]:
    """PIDs of this machine's Ray worker processes whose command line starts with ``title``
    (Ray names them ``ray::<actor class>``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(title):
                pids.append(int(entry))
    return pids


def kill_one(title: str, timeout_s: float = 120.0) -> int:
    """SIGKILL one process ``ray_worker_pids(title)`` finds, waiting up to ``timeout_s`` for one
    to exist; returns its PID."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = ray_worker_pids(title)
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"no process {title!r} within {timeout_s} s")
