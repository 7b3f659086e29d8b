"""Kernel-graph fuzz cases, evaluated in a guarded child process (tests/fuzz/graph_server.py).

tests/test_fuzz_graphs.py draws cases with hypothesis and sends them here through
``GuardedServer``: a long-lived child process that builds and runs each case and answers with a
verdict ``{"ok": bool, "problem": str}``. A case that kills the process (SIGSEGV, abort) comes
back as ``{"ok": False, "crash": "SIGSEGV", ...}`` and the next case starts a fresh process, so a
kernel that reads out of bounds fails one test example instead of the whole test run.

Case kinds (``evaluate(kind, case)``):

- ``graph``: ``{"graph": KNGraph JSON, "backend", "seed", "tolerance": [per output],
  "argmax_of": {output index: index of the output it is the argmax of}}``: run on the backend
  and with the reference interpreter (``g.interpret``); outputs must agree (fp32 ~1e-4 relative
  to the output's magnitude; argmax indices may differ only between near-equal values).
- ``embedding``: ``{"backend", "vocab", "dim", "dtype", "ids", "ids_shape", "ids_dtype", "seed"}``:
  ids all in [0, vocab) -> equal to ``F.embedding`` (of the dequantized table for q8_0/q4_1);
  otherwise ``yr.IndexOutOfRangeError`` whose message names the op, an offending id and the
  range ``[0, vocab)``; then the same compiled graph still works on valid ids.
- ``rope`` / ``attention``: ``{"backend", "T", "H"/"Hq", "Hkv", "Dh", "S", "start", "seed"}``:
  0 <= start <= S - T -> equal to the reference (attention: the KV caches too); otherwise
  ``yr.IndexOutOfRangeError`` naming the op, the start position and ``[0, S - T + 1)``, with the
  KV caches unchanged.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SERVER = Path(__file__).with_name("graph_server.py")


# ================================================================================================
# evaluation (runs in the server process)

def _exc(e: BaseException) -> str:
    return f"{type(e).__module__}.{type(e).__qualname__}: {e}"


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]


def _device(backend: str):
    from yirage.backends import get_backend_impl

    return get_backend_impl(backend).torch_device


def _random_input(ttype, gen):
    import torch

    dtype = ttype.dtype
    if dtype.is_quantized:  # valid blocks of random values (raw uint8 storage)
        return _quantized(ttype.shape, dtype.value, gen)
    if dtype.is_float:
        return torch.randn(ttype.shape, generator=gen).to(dtype.torch_dtype)
    return torch.randint(0, 4, ttype.shape, generator=gen, dtype=dtype.torch_dtype)


def _close(a, b, tol: float):
    """None when float tensors a, b agree: |a - b| <= tol * (1 + max|b|) + tol * |b| (NaN == NaN);
    else a description of the worst element."""
    import torch

    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return f"NaN at {int((nan_a != nan_b).sum())} positions where the reference has none (or vice versa)"
    fa, fb = a[~nan_a], b[~nan_b]
    if fb.numel() == 0:
        return None
    inf_mismatch = (torch.isinf(fa) | torch.isinf(fb)) & (fa != fb)
    if inf_mismatch.any():
        return "inf values differ from the reference"
    fin = ~torch.isinf(fb)
    fa, fb = fa[fin], fb[fin]
    if fb.numel() == 0:
        return None
    scale = 1.0 + float(fb.abs().max())
    err = (fa - fb).abs()
    bound = tol * scale + tol * fb.abs()
    if bool((err > bound).any()):
        i = int(torch.argmax(err - bound))
        return f"max error {float(err[i]):.3g} at flat index {i} (got {float(fa[i]):.6g}, reference {float(fb[i]):.6g})"
    return None


def eval_graph(case: dict) -> dict:
    import torch

    import yirage as yr

    backend = case["backend"]
    g = yr.KNGraph.from_json(case["graph"])
    gen = torch.Generator().manual_seed(int(case["seed"]))
    inputs = [_random_input(g.tensors[i], gen) for i in g.inputs]
    dev = _device(backend)
    try:
        out = [o.cpu() for o in g(inputs=[x.clone().to(dev) for x in inputs], backend=backend)]
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "problem": f"running on {backend} raised {_exc(e)}", "traceback": _tb(e)}
    try:
        ref = g.interpret([x.clone() for x in inputs])
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "problem": f"the reference interpreter raised {_exc(e)}", "traceback": _tb(e)}
    if len(out) != len(ref):
        return {"ok": False, "problem": f"{len(out)} outputs, the reference has {len(ref)}"}
    argmax_of = {int(k): v for k, v in case.get("argmax_of", {}).items()}
    for i, (a, b) in enumerate(zip(out, ref)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return {"ok": False, "problem": f"output {i}: {a.dtype} {tuple(a.shape)} != reference {b.dtype} "
                                            f"{tuple(b.shape)}"}
        if i in argmax_of:
            src = ref[argmax_of[i]].float()
            picked = torch.gather(src, -1, a.unsqueeze(-1)).squeeze(-1)
            best = src.max(dim=-1).values
            if not bool((picked >= best - case["tolerance"][i] * (1 + best.abs())).all()):
                return {"ok": False, "problem": f"output {i} (argmax): indices {a.tolist()} do not point at the "
                                                f"maxima {b.tolist()} (not a near-tie)"}
            continue
        if not b.dtype.is_floating_point:
            if not torch.equal(a, b):
                return {"ok": False, "problem": f"output {i}: {a.tolist()} != reference {b.tolist()}"}
            continue
        why = _close(a, b, case["tolerance"][i])
        if why:
            return {"ok": False, "problem": f"output {i} ({b.dtype}, shape {tuple(b.shape)}): {why}"}
    return {"ok": True}


def _index_error_problem(e: BaseException, op: str, values: list[int], lo: int, hi: int) -> str | None:
    """None if ``e`` is the IndexOutOfRangeError the bounds-check rule asks for."""
    import yirage as yr

    if not isinstance(e, yr.IndexOutOfRangeError):
        return f"raised {_exc(e)}; expected yr.IndexOutOfRangeError"
    msg = str(e)
    missing = []
    if op not in msg:
        missing.append(f"the op {op!r}")
    if not any(str(v) in msg for v in values):
        missing.append(f"the offending value (one of {values[:6]})")
    if f"[{lo}, {hi})" not in msg:
        missing.append(f"the valid range [{lo}, {hi})")
    if missing:
        return f"IndexOutOfRangeError message {msg!r} does not name {', '.join(missing)}"
    return None


def _quantized(shape, dtype_name: str, gen):
    import gguf
    import numpy as np
    import torch

    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1}[dtype_name]
    values = torch.randn(shape, generator=gen).numpy().astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(values, qtype)))


def eval_embedding(case: dict) -> dict:
    import torch
    import torch.nn.functional as F

    import yirage as yr
    from yirage.ir.ops import dequantize

    backend, vocab, dim, dname = case["backend"], case["vocab"], case["dim"], case["dtype"]
    dtype = yr.DType(dname)
    gen = torch.Generator().manual_seed(int(case["seed"]))
    table = _quantized((vocab, dim), dname, gen) if dtype.is_quantized else torch.randn(vocab, dim, generator=gen)
    ids_dtype = {"int64": torch.int64, "int32": torch.int32}[case["ids_dtype"]]
    ids = torch.tensor(case["ids"], dtype=ids_dtype).reshape(case["ids_shape"])
    g = yr.new_kernel_graph()
    ids_in = g.new_input(tuple(ids.shape), yr.DType(case["ids_dtype"]))
    table_in = g.new_input((vocab, dim), dtype)
    g.mark_output(g.embedding(ids_in, table_in))
    dev = _device(backend)
    dense = dequantize(table, dtype, (vocab, dim)) if dtype.is_quantized else table
    bad = [int(i) for i in ids.reshape(-1).tolist() if not 0 <= int(i) < vocab]
    try:
        out = g(inputs=[ids.to(dev), table.to(dev)], backend=backend)[0].cpu()
    except BaseException as e:  # noqa: BLE001
        if not bad:
            return {"ok": False, "problem": f"ids all in range, but it raised {_exc(e)}", "traceback": _tb(e)}
        why = _index_error_problem(e, "embedding", bad, 0, vocab)
        if why:
            return {"ok": False, "problem": why, "traceback": _tb(e)}
        good = ids.clamp(0, vocab - 1)  # the compiled graph must still work
        try:
            again = g(inputs=[good.to(dev), table.to(dev)], backend=backend)[0].cpu()
        except BaseException as e2:  # noqa: BLE001
            return {"ok": False, "problem": f"after the IndexOutOfRangeError, valid ids raised {_exc(e2)}"}
        why = _close(again, F.embedding(good.long(), dense), 1e-6)
        return {"ok": False, "problem": f"after the IndexOutOfRangeError, valid ids gave wrong rows: {why}"} \
            if why else {"ok": True}
    if bad:
        return {"ok": False, "problem": f"ids {bad[:6]} are outside [0, {vocab}) but no error was raised"}
    why = _close(out, F.embedding(ids.long(), dense), 1e-6 if dtype.is_quantized else 0.0)
    return {"ok": False, "problem": f"rows differ from F.embedding: {why}"} if why else {"ok": True}


def _positions_case(case: dict, op: str) -> dict:
    import torch

    import yirage as yr

    backend, T, Dh, S, start = case["backend"], case["T"], case["Dh"], case["S"], int(case["start"])
    gen = torch.Generator().manual_seed(int(case["seed"]))
    g = yr.new_kernel_graph()
    pos_in = None
    try:
        if op == "rope":
            H = case["H"]
            x_in = g.new_input((T, H, Dh))
            c_in, s_in = g.new_input((S, Dh // 2)), g.new_input((S, Dh // 2))
            pos_in = g.new_input((1,), yr.int64)
            g.mark_output(g.rope(x_in, c_in, s_in, pos_in))
            tensors = [torch.randn(T, H, Dh, generator=gen), torch.randn(S, Dh // 2, generator=gen),
                       torch.randn(S, Dh // 2, generator=gen)]
            caches = []
        else:
            Hq, Hkv = case["Hq"], case["Hkv"]
            q_in, k_in, v_in = g.new_input((T, Hq, Dh)), g.new_input((T, Hkv, Dh)), g.new_input((T, Hkv, Dh))
            kc_in, vc_in = g.new_input((S, Hkv, Dh)), g.new_input((S, Hkv, Dh))
            pos_in = g.new_input((1,), yr.int64)
            g.mark_output(g.attention(q_in, k_in, v_in, kc_in, vc_in, pos_in))
            tensors = [torch.randn(T, Hq, Dh, generator=gen), torch.randn(T, Hkv, Dh, generator=gen),
                       torch.randn(T, Hkv, Dh, generator=gen)]
            caches = [torch.randn(S, Hkv, Dh, generator=gen), torch.randn(S, Hkv, Dh, generator=gen)]
    except yr.GraphError as e:
        return {"ok": True, "build_error": str(e)}
    except BaseException as e:  # noqa: BLE001
        return {"ok": False, "problem": f"building the graph raised {_exc(e)} (not GraphError)", "traceback": _tb(e)}
    dev = _device(backend)
    pos = torch.tensor([start], dtype=torch.int64)
    run_caches = [c.clone().to(dev) for c in caches]
    in_range = 0 <= start <= S - T
    try:
        out = g(inputs=[t.to(dev) for t in tensors] + run_caches + [pos.to(dev)], backend=backend)[0].cpu()
    except BaseException as e:  # noqa: BLE001
        if in_range:
            return {"ok": False, "problem": f"start {start} is in range [0, {S - T + 1}) but it raised {_exc(e)}",
                    "traceback": _tb(e)}
        why = _index_error_problem(e, op, [start], 0, S - T + 1)
        if why:
            return {"ok": False, "problem": why, "traceback": _tb(e)}
        for name, before, after in zip(("k_cache", "v_cache"), caches, run_caches):
            if not torch.equal(before, after.cpu()):
                rows = torch.nonzero((before != after.cpu()).any(-1).any(-1)).reshape(-1).tolist()
                return {"ok": False, "problem": f"the error was raised, but {name} rows {rows[:8]} were written"}
        return {"ok": True}
    if not in_range:
        return {"ok": False, "problem": f"start {start} is outside [0, {S - T + 1}) but no error was raised"}
    ref_caches = [c.clone() for c in caches]
    ref = g.interpret(tensors + ref_caches + [pos])[0]
    why = _close(out, ref, 1e-4)
    if why:
        return {"ok": False, "problem": f"output differs from the reference: {why}"}
    for name, a, b in zip(("k_cache", "v_cache"), run_caches, ref_caches):
        why = _close(a.cpu(), b, 0.0)
        if why:
            return {"ok": False, "problem": f"{name} differs from the reference's: {why}"}
    return {"ok": True}


def eval_rope(case: dict) -> dict:
    return _positions_case(case, "rope")


def eval_attention(case: dict) -> dict:
    return _positions_case(case, "attention")


EVALUATORS = {"graph": eval_graph, "embedding": eval_embedding, "rope": eval_rope, "attention": eval_attention}


def evaluate(kind: str, case: dict) -> dict:
    try:
        return EVALUATORS[kind](case)
    except BaseException as e:  # noqa: BLE001: a bug of the evaluator or an unexpected raise
        return {"ok": False, "problem": f"evaluating the case raised {_exc(e)}", "traceback": _tb(e)}


# ================================================================================================
# the client (runs in the test process)

class GuardedServer:
    """A child process evaluating cases (``call(kind, case)``); restarted after it dies.

    A case that crashes the process or takes longer than ``timeout`` seconds returns
    ``{"ok": False, "crash"|"hang": ..., "problem": ..., "log": <faulthandler/stderr tail>}``.
    """

    def __init__(self, timeout: float = 120.0, env: dict | None = None):
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.restarts = 0

    def _start(self) -> None:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=self.env)
        line = self._readline(300.0)
        if not line or not json.loads(line).get("ready"):
            tail = self._log_tail()
            self.close()
            raise RuntimeError(f"the graph fuzz server did not start:\n{tail}")

    def _readline(self, timeout: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buf += chunk
        return buf

    def _log_tail(self, n: int = 3000) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read()[-n:].decode("utf-8", "replace")

    def call(self, kind: str, case: dict) -> dict:
        if self.proc is None:
            self._start()
        self.proc.stdin.write((json.dumps({"kind": kind, "case": case}) + "\n").encode())
        self.proc.stdin.flush()
        line = self._readline(self.timeout)
        if line:
            return json.loads(line)
        if line is None:  # no answer in time
            self.proc.kill()
            self.proc.wait()
            out = {"ok": False, "hang": True, "problem": f"no answer in {self.timeout:.0f} s (killed)",
                   "log": self._log_tail()}
        else:
            code = self.proc.wait()
            what = signal.Signals(-code).name if code < 0 and -code in signal.Signals._value2member_map_ else \
                f"exit status {code}"
            out = {"ok": False, "crash": what, "problem": f"the process died ({what})", "log": self._log_tail()}
        self._reset()
        return out

    def _reset(self) -> None:
        self.restarts += 1
        if self.log is not None:
            self.log.close()
        self.proc, self.log = None, None

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()
        self.proc, self.log = None, None
