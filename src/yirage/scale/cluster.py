"""Connecting to Ray: a local instance started for this process, the cluster running on this host
(``auto``: ``ray start --head`` was run here), or a cluster's head at ``HOST:PORT``; each with a
clear error, within ``CONNECT_TIMEOUT_S``, where nothing answers (Ray's own client retries for
minutes).
"""
from __future__ import annotations

import logging
import os
import socket
import threading

from ..errors import YirageError

#: seconds within which a Ray address that does not answer is an error (YIRAGE_RAY_CONNECT_TIMEOUT_S)
CONNECT_TIMEOUT_S = float(os.environ.get("YIRAGE_RAY_CONNECT_TIMEOUT_S") or 30.0)
#: seconds a TCP connection to the head's GCS port may take
PROBE_TIMEOUT_S = 5.0


class RayUnavailableError(YirageError):
    """Ray is not installed, or the Ray address given does not answer. The message names the
    address and says what to run (``pip install 'yirage[scale]'``, ``ray start --head``)."""


def import_ray():
    """The ``ray`` module; RayUnavailableError saying how to install it where it is missing."""
    try:
        import ray
    except ImportError:
        raise RayUnavailableError("--ray and --replicas need Ray: pip install 'yirage[scale]' "
                                  "(or pip install 'ray[data,serve]')") from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None):
    """Connect this process to Ray, once (a process already connected keeps its connection).

    Args:
        address: None or ``local``: start a Ray instance of this process on this machine (or
            join ``RAY_ADDRESS``'s where that is set), with ``num_cpus`` CPUs (None: all);
            ``auto``: the cluster started on this host with ``ray start``; ``HOST:PORT``: the
            head node's GCS address (``ray start --head`` prints it; port 6379 by default);
            ``ray://HOST:PORT``: a Ray Client server.

    Returns: the ``ray`` module, connected.

    Raises:
        RayUnavailableError: Ray is missing; ``auto`` finds no cluster on this host; the address
            does not accept a connection within ``PROBE_TIMEOUT_S`` seconds, or Ray does not
            connect within ``CONNECT_TIMEOUT_S``.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    local = address in (None, "", "local")
    target = os.environ.get("RAY_ADDRESS") if local else address
    if target and target != "auto":
        _probe(target)
    kwargs = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    if local and not target:
        kwargs["num_cpus"] = num_cpus
    outcome: list = []

    def init() -> None:
        try:
            outcome.append(ray.init(address=target or None, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(e)

    if not target or target == "auto":   # starts Ray here, or reads this host's cluster file: no wait
        init()
    else:   # a remote head: Ray's client retries for minutes, so it waits in a thread, with a limit
        thread = threading.Thread(target=init, name="yirage-ray-connect", daemon=True)
        thread.start()
        thread.join(CONNECT_TIMEOUT_S)
    if not outcome:
        raise RayUnavailableError(f"Ray at {target} did not connect within {CONNECT_TIMEOUT_S:.0f} s: check the "
                                  "address, that 'ray status' works there, and that the versions of Ray and Python "
                                  "match")
    if isinstance(outcome[0], BaseException):
        e = outcome[0]
        if target == "auto" and isinstance(e, ConnectionError):
            raise RayUnavailableError("--ray auto / --ray-address auto: no Ray cluster runs on this host: start one "
                                      "with 'ray start --head', or give HOST:PORT of the head node") from None
        raise RayUnavailableError(f"cannot connect to Ray at {target or 'this machine'}: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    return ray


def _probe(address: str) -> None:
    """RayUnavailableError unless ``address`` (``[ray://]HOST:PORT``) accepts a TCP connection
    within ``PROBE_TIMEOUT_S`` seconds."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise RayUnavailableError(f"Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379), 'auto' or 'local'")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise RayUnavailableError(f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}): start the "
                                  "head with 'ray start --head' there, and check the address and the firewall") \
            from None
