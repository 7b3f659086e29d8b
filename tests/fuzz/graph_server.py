"""The guarded process of tests/fuzz/graphs.py: evaluates kernel-graph fuzz cases.

Reads ``{"kind", "case"}`` JSON lines on stdin and answers each with one verdict line on
stdout (``graphs.evaluate``); prints ``{"ready": true}`` first. faulthandler writes the Python
stack to stderr if a kernel kills the process, so the client can say where it crashed.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: import fuzz.graphs


def main() -> int:
    faulthandler.enable(all_threads=True)
    try:  # Linux: die with the test process (PR_SET_PDEATHSIG = SIGKILL)
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # verdicts go here; stray prints go to stderr
    os.dup2(2, 1)
    import torch  # noqa: F401

    import yirage  # noqa: F401
    from fuzz import graphs

    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        proto.write(json.dumps(graphs.evaluate(req["kind"], req["case"]), default=repr) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
