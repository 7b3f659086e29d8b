"""``yirage optimize``, ``yr.auto_configure_backend()`` and ``yr.BackendOptimizer()``: the seed's
backend manager (YiRage's ``yirage_backend_manager.py``) made real.

``optimize()`` measures, ahead of time, the kernel providers of every library-op shape class
that the registry's models and Mirage's graph family use (``workload_cases``) and the thread
count of the embedding encoder, prints what it measured, and writes a machine profile
(``yirage.tuning``): ``<machine key>.optimize.json`` always, and with ``apply`` merged into the
profile the backends read (``<machine key>.json``). ``auto_configure_backend()`` reads that
profile (or a shipped template, or nothing) back as a recommendation.

This module measures and reports through ``tuning`` and the CPU backend's providers; it must
never choose a provider itself (``tuning.record`` does: the fastest median).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import Backend, get_available_backends, get_backend_info, resolve_backend
from ..backends.cpu import providers as cpu_providers
from ..backends.cpu.precision import is_native
from ..errors import YirageError
from ..runtime.machine import machine_record, usable_cpu_count
from ..tuning import profile as tuning

#: rows (M) a linear layer is measured at: a decode-like few rows, then prefill / encoder batches
M_BUCKETS = (16, 64, 256, 512, 1024)
#: Mirage's benchmark graphs' matmuls as linear layers (M, N, K): gated MLP, RMSNorm + linear, LoRA
MIRAGE_LINEARS = ((8, 4096, 4096), (2, 6144, 4096), (16, 256, 256))
DEFAULT_BUDGET_S = 60.0


#: prompt lengths (M) the LLM's quantized prefill GEMMs are measured at
PREFILL_BUCKETS = (16, 64, 256, 512)
#: the projections of an LLM layer measured (one per distinct shape and format)
LLM_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Workload:
    """A linear layer shape of a workload: ``name`` (what uses it), N, K, the ``dtypes`` it runs
    in (a GGUF block format such as 'q4_1', and '<format>/bfloat16' for its bfloat16 compute),
    the ``rows`` it is measured at, the int8 activation ``group``, and the real ``weight`` of a
    block-quantized layer (uint8 blocks; None: random weights are made)."""

    name: str
    N: int
    K: int
    dtypes: tuple[str, ...]
    rows: tuple[int, ...] = M_BUCKETS
    group: int = 0
    weight: torch.Tensor | None = None


def _llm_workloads() -> list[Workload]:
    """The block-quantized projections of the default LLM's first layer (its real weights), as
    prefill GEMMs in float32 and in bfloat16 compute; none when the model is not installed."""
    from ..models.loading import load_model
    from ..models.registry import DEFAULT_MODEL

    try:
        loaded = load_model(DEFAULT_MODEL, progress=False)
    except YirageError:
        return []
    out, seen = [], set()
    for proj in LLM_PROJECTIONS:
        w = loaded.weights.get(f"model.layers.0.{proj}.weight")
        if w is None or not w.dtype.is_quantized:
            continue
        N, K = w.shape
        if (N, K, w.dtype) not in seen:
            seen.add((N, K, w.dtype))
            fmt = w.dtype.value
            out.append(Workload(f"{DEFAULT_MODEL} {proj}", N, K, (fmt, f"{fmt}/bfloat16"), PREFILL_BUCKETS,
                                weight=w.data))
    return out


def workload_cases() -> list[Workload]:
    """The linear shapes of the default embedding model (float32, bfloat16, int8), of the default
    LLM's quantized prefill GEMMs (float32 and bfloat16 compute) and of Mirage's graph family
    (float32)."""
    from ..models.bert import BertConfig, int8_group
    from ..models.registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model

    cases = []
    try:
        config = BertConfig.from_json(resolve_embedding_model(DEFAULT_EMBEDDING_MODEL) / "config.json")
    except YirageError:
        config = None      # the embedding model is not installed here: Mirage's shapes only
    if config is not None:
        H, I = config.hidden_size, config.intermediate_size
        for what, N, K in (("qkv", 3 * H, H), ("attention out", H, H), ("intermediate", I, H), ("output", H, I)):
            cases.append(Workload(f"{DEFAULT_EMBEDDING_MODEL} {what}", N, K, ("float32", "bfloat16", "int8"),
                                  group=int8_group(config)))
    cases += _llm_workloads()
    for M, N, K in MIRAGE_LINEARS:
        cases.append(Workload(f"Mirage {M}x{K}x{N}", N, K, ("float32",), rows=(M,)))
    return cases


def _weight_args(w: Workload, dtype: str) -> list[torch.Tensor]:
    """Random constant weights of the workload, or its real block-quantized ones (x is made by
    the provider's measurement)."""
    if w.weight is not None:
        return [torch.empty(0), w.weight]
    if dtype == "int8":
        args = [torch.empty(0), torch.randint(-127, 128, (w.K, w.N), dtype=torch.int8), torch.rand(w.N) / 100,
                torch.randn(w.N)]
    else:
        weight = (torch.randn(w.N, w.K) / w.K ** 0.5).to(getattr(torch, dtype))
        args = [torch.empty(0), weight, torch.randn(w.N)]
    from ..backends.cpu.embed import mark_constant
    mark_constant(args[1])
    return args


def shape_classes() -> list[tuple[Workload, cpu_providers.Case, list[torch.Tensor]]]:
    """(workload, provider case, the op's tensors with random constant weights) for every
    (workload, dtype, rows) of ``workload_cases()``; x in the tensors is a placeholder."""
    todo = []
    for w in workload_cases():
        for dtype in w.dtypes:
            args = _weight_args(w, dtype)
            for M in w.rows:
                case = cpu_providers.Case("linear_w8a8" if dtype == "int8" else "linear", dtype, M, w.N, w.K,
                                          w.group if dtype == "int8" else 0, constant=w.weight is None)
                todo.append((w, case, args))
    return todo


def _measure_cases(budget_s: float, say) -> tuple[tuning.Profile, list[dict]]:
    """Measure every shape class with more than one provider; returns the profile of the
    measurements and one row per case for the table."""
    todo = shape_classes()
    prof = tuning.Profile(tuning.profile_path(".optimize"), meta={"measured_by": "yirage optimize"})
    rows, per_case = [], budget_s / max(1, len(todo))
    for w, case, args in todo:
        cands = cpu_providers.candidates(case)
        row = {"workload": w.name, "op": case.op, "dtype": case.dtype, "M": case.M, "N": case.N, "K": case.K,
               "key": case.key(), "median_s": {}, "choice": next(iter(cands))}
        # bfloat16 compute of a quantized weight has one provider, timed to recommend it or not
        if len(cands) > 1 or case.dtype.endswith("/bfloat16"):
            comparison = cpu_providers.measure(case, args, per_case)
            tuning.record(case.key(), comparison, "yirage optimize", prof)
            entry = prof.entries[case.key()]   # as record() marked it: busy (not applied) or a close race
            row.update(median_s={n: comparison.median(n) for n in comparison.names}, choice=comparison.fastest(),
                       noisy=entry.get("noisy"), close=entry.get("close"))
        rows.append(row)
        say(row)
    return prof, rows


def _embedding_threads(budget_s: float) -> dict | None:
    """Sentences/s of the default embedding model at 1..cores threads, and the best count (None
    when the model is not installed or there is one core)."""
    cores = usable_cpu_count()
    if cores < 2:
        return None
    from ..engines.embed import EmbeddingModel
    from ..runtime import timing

    try:
        model = EmbeddingModel(backend="cpu")
    except YirageError:
        return None
    texts = [f"Sentence number {i} says something about the weather in town {i % 7}." for i in range(64)]
    before = torch.get_num_threads()
    counts = sorted({1, cores // 2 or 1, cores})
    runs = {}
    for t in counts:
        def run(t=t):
            torch.set_num_threads(t)
            model.encode(texts)
        runs[t] = run
    try:
        c = timing.compare({str(t): runs[t] for t in counts}, rounds=5, min_sample_s=0.05,
                           deadline=time.perf_counter() + budget_s)
    finally:
        torch.set_num_threads(before)
    per_s = {t: len(texts) / c.median(str(t)) for t in counts}
    return {"sentences_per_s": per_s, "best": max(per_s, key=per_s.get)}


def check_arguments(backend: str | None, budget_s: float) -> None:
    """YirageError unless ``backend`` is the CPU (or None/'auto' resolving to it) and ``budget_s``
    a positive number; BackendUnavailableError for an unknown or unavailable backend."""
    name = resolve_backend(backend or "cpu")
    if name != Backend.CPU:
        raise YirageError(f"yirage optimize measures the CPU backend's kernel providers; backend '{name.value}' "
                          "has no provider choice to measure (its Triton kernels autotune their own tiles)")
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise YirageError(f"the budget must be a positive number of seconds, got {budget_s!r}")


def optimize(backend: str | None = None, budget_s: float = DEFAULT_BUDGET_S, apply: bool = False,
             say=None) -> dict:
    """Measure the CPU backend's kernel providers on this machine and write a machine profile.

    Args:
        backend: 'cpu' (or None / 'auto' resolving to it); the GPU backends have no provider
            choice (Triton autotunes its own tiles).
        budget_s: seconds in all, shared by the shape classes (each gets at least 3 rounds).
        apply: merge the measurements into the profile the backends read.
        say: called with each measured row (a dict), e.g. to print progress.

    Returns: {"profile": path written, "applied": path or None, "machine": machine_record(),
    "cases": rows (workload, op, dtype, M, N, K, key, median_s per provider, choice), "threads":
    the embedding encoder's sentences/s per thread count, "busy": why figures may be noisy}.
    Raises: YirageError for a non-CPU backend or a budget that is not a positive number;
    BackendUnavailableError for an unknown backend.
    """
    check_arguments(backend, budget_s)
    busy = tuning.busy_reason()
    prof, rows = _measure_cases(0.85 * budget_s, say or (lambda row: None))
    threads = _embedding_threads(0.15 * budget_s)
    if threads is not None:
        prof.extra["threads"] = {"embedding": threads["best"]}
    prof.save()
    applied = None
    if apply:
        active = tuning.Profile.read(tuning.profile_path())
        active.entries.update({k: e for k, e in prof.entries.items() if "noisy" not in e})
        active.extra.update(prof.extra)
        active.save()
        tuning.reload_profile()
        applied = str(active.path)
    return {"profile": str(prof.path), "applied": applied, "machine": machine_record(), "cases": rows,
            "threads": threads, "busy": busy}


def _bfloat16_pays(entries: dict, float32: str, bfloat16: str) -> bool:
    """Do the measured GEMMs of dtype ``bfloat16`` take under 0.8x those of ``float32`` (the
    fastest provider of each, summed over the shape classes of M 256 and 512 measured in both)?"""
    best: dict[str, dict[str, float]] = {float32: {}, bfloat16: {}}
    for key, e in entries.items():
        op, dtype, m = key.split("|")[:3]
        if op == "linear" and dtype in best and m in ("m256", "m512") and e.get("median_s"):
            best[dtype][key.replace(dtype, "", 1)] = min(e["median_s"].values())
    both = set(best[float32]) & set(best[bfloat16])
    f32, bf16 = (sum(best[d][k] for k in both) for d in (float32, bfloat16))
    return bool(both) and bf16 < 0.8 * f32


def _recommended_dtypes(backend: Backend, entries: dict) -> dict[str, str]:
    """The dtype per workload: on GPUs bfloat16 (their tensor cores); on the CPU float32 wherever
    bfloat16 is emulated (``cpu.precision.is_native``: no AMX-BF16, AVX512-BF16 or AVX-NE-CONVERT
    under ``YIRAGE_ISA``'s cap), else the embedding
    model's bfloat16 when its measured GEMMs take under 0.8x float32's time at the encoder's batch
    sizes, else float32; an LLM's activations float32, its ``prefill_dtype`` bfloat16 when the
    quantized prefill GEMMs in bfloat16 compute measured under 0.8x float32's; kernel graphs
    float32."""
    if backend not in (Backend.CPU, Backend.TRITON_INTERPRET):
        return {"embedding": "bfloat16", "llm": "bfloat16", "llm_prefill": "bfloat16", "kernel_graph": "float32"}
    if not is_native("bfloat16"):   # emulated here: never recommended, whatever was measured
        return {"embedding": "float32", "llm": "float32", "llm_prefill": "float32", "kernel_graph": "float32"}
    formats = {key.split("|")[1].split("/")[0] for key in entries if key.split("|")[1].endswith("/bfloat16")}
    prefill = any(_bfloat16_pays(entries, f, f"{f}/bfloat16") for f in formats)
    return {"embedding": "bfloat16" if _bfloat16_pays(entries, "float32", "bfloat16") else "float32",
            "llm": "float32", "llm_prefill": "bfloat16" if prefill else "float32", "kernel_graph": "float32"}


def auto_configure_backend() -> dict:
    """What yirage will use on this machine, from its measurements.

    Returns a dict: ``backend`` (what 'auto' resolves to), ``threads`` (the embedding encoder's
    measured best thread count, else the usable cores), ``dtypes`` (recommended activation dtype
    per workload: embedding, llm, llm_prefill (``yr.LLM``'s ``prefill_dtype``), kernel_graph),
    ``kernel_choices`` ({shape class: provider}),
    ``profile`` (the path of this machine's profile, or None if it has none yet), ``source``
    ('profile', 'template <name>' or 'defaults'), ``tune`` (YIRAGE_TUNE's mode).
    """
    backend = resolve_backend("auto")
    prof = tuning.active_profile()
    entries, extra, source = prof.entries, prof.extra, "profile"
    if not entries:
        tpl = tuning.matching_template()
        entries, extra, source = ({}, {}, "defaults") if tpl is None else (
            tpl[1].get("entries", {}), tpl[1].get("extra", {}), f"template {tpl[0]}")
    threads = extra.get("threads", {}).get("embedding") or usable_cpu_count()
    return {"backend": backend.value, "threads": threads, "dtypes": _recommended_dtypes(backend, entries),
            "kernel_choices": {k: e["choice"] for k, e in sorted(entries.items())},
            "profile": str(prof.path) if prof.path is not None and Path(prof.path).exists() else None,
            "source": source, "tune": tuning.tune_mode()}


class BackendOptimizer:
    """The seed's ``BackendOptimizer``: system information, provider measurement, and a
    configuration file to carry a machine's choices (``save_config``/``load_config``)."""

    def system_info(self) -> dict:
        """The machine record and every backend's info (``BackendInfo.to_dict``)."""
        from ..backends import Backend as B
        return {"machine": machine_record(), "backends": [get_backend_info(b).to_dict() for b in B],
                "available": [b.value for b in get_available_backends()]}

    def print_system_info(self) -> None:
        """Print ``system_info()`` as a table (rich)."""
        from rich.console import Console
        from rich.table import Table

        info = self.system_info()
        m = info["machine"]
        table = Table(title="yirage system")
        table.add_column("field")
        table.add_column("value")
        for k in ("cpu", "cores", "threads", "amx", "torch", "mkl", "onednn", "yirage"):
            table.add_row(k, str(m[k]))
        table.add_row("isa", " ".join(m["isa"]))
        for b in info["backends"]:
            table.add_row(f"backend {b['name']}", "available" if b["available"] else f"no: {b['reason']}")
        Console().print(table)

    def optimize(self, backend: str | None = None, budget_s: float = DEFAULT_BUDGET_S, apply: bool = True) -> dict:
        """``optimize(backend, budget_s, apply)`` (applied by default: the Python API means it)."""
        return optimize(backend, budget_s, apply)

    def save_config(self, path, backend: str | None = None) -> Path:
        """Write this machine's configuration to ``path`` (JSON): the backend (``backend`` or
        what 'auto' resolves to), ``auto_configure_backend()``'s recommendation, and the profile's
        entries with the machine they were measured on. Returns the path. YirageError when the
        file cannot be written; BackendUnavailableError for an unknown/unavailable backend."""
        chosen = resolve_backend(backend or "auto")
        conf = auto_configure_backend()
        doc = {"format": 1, "backend": chosen.value, "threads": conf["threads"], "dtypes": conf["dtypes"],
               "machine": tuning.machine_identity(), "entries": tuning.active_profile().entries}
        path = Path(path)
        try:
            path.write_text(json.dumps(doc, indent=1, sort_keys=True))
        except OSError as e:
            raise YirageError(f"cannot write {path}: {e.strerror or e}") from None
        return path

    def load_config(self, path) -> dict:
        """Read a file of ``save_config``: make its backend the default (``set_backend``) and,
        when it was measured on this machine (same CPU, ISA and library versions), its provider
        choices part of this machine's profile. Returns the document. YirageError for a missing
        or malformed file; BackendUnavailableError when its backend is unavailable here."""
        from ..backends import set_backend

        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise YirageError(f"cannot read the configuration {path}: {e}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("backend"), str) or \
                not isinstance(doc.get("entries", {}), dict):
            raise YirageError(f"{path} is not a yirage configuration (written by BackendOptimizer.save_config)")
        set_backend(doc["backend"])
        if doc.get("machine") == tuning.machine_identity() and doc.get("entries"):
            prof = tuning.active_profile()
            prof.entries.update(doc["entries"])
            if prof.path is not None:
                prof.save()
        return doc


__all__ = ["optimize", "auto_configure_backend", "BackendOptimizer", "workload_cases", "shape_classes",
           "DEFAULT_BUDGET_S"]
