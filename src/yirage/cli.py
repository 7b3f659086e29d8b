"""The ``yirage`` command line: ``yirage info`` and ``yirage generate``.

Every failure the user can cause (bad model, backend, prompt, numbers) prints one line on
stderr and exits non-zero; it must never print a traceback for those.
"""
from __future__ import annotations

import json
import sys

import click

from .errors import YirageError

EXIT_ERROR = 1


def _fail(message: str) -> None:
    click.echo(f"yirage: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="yirage")
def cli() -> None:
    """yirage: compile and run tensor programs and LLMs on CPU, CUDA, ROCm, XPU and MPS."""


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


@cli.command()
def info() -> None:
    """Show every known backend: available or why not, device, memory, ISA/compute capability,
    and whether fused kernels are compiled (C++, Triton) or run as torch ops."""
    from rich.console import Console
    from rich.table import Table

    from .backends import Backend, get_backend, get_backend_info, get_backend_source

    table = Table(title="yirage backends")
    for col in ("backend", "available", "kernels", "device", "units", "memory", "ISA / compute capability"):
        table.add_column(col)
    for b in Backend:
        i = get_backend_info(b)
        if not i.available:
            table.add_row(b.value, f"no: {i.reason}", i.kernels, "-", "-", "-", "-")
            continue
        feats = i.compute_capability or " ".join(i.isa_flags) or "-"
        table.add_row(b.value, "yes", i.kernels, i.device_name or "-", str(i.compute_units or "-"),
                      _gib(i.memory_total_bytes), feats)
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the reasons into 80 columns
        console = Console(width=160)
    console.print(table)
    try:
        default, source = get_backend().value, get_backend_source()
    except YirageError as e:
        _fail(str(e))
    console.print(f"default backend: [bold]{default}[/bold] (from {source})")


@cli.command()
@click.argument("prompt")
@click.option("-m", "--model", default="smollm2-135m-instruct", show_default=True,
              help="Short name, GGUF file, Hugging Face directory or hub id.")
@click.option("--backend", default=None, help="cpu, cuda, rocm, xpu, mps or auto (default: YIRAGE_BACKEND or auto).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--max-seq-length", type=int, default=2048, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Activation dtype (default: float32 on the CPU, bfloat16/float16 on GPUs).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate(prompt, model, backend, max_new_tokens, max_seq_length, dtype, temperature, top_k, top_p,
             seed, system, as_json) -> None:
    """Generate a reply to PROMPT, streaming it to stdout."""
    from .engines.generate import LLM, check_generation_args

    try:
        check_generation_args(max_new_tokens, temperature, top_k, top_p)
        llm = LLM(model, backend=backend, max_seq_length=max_seq_length, dtype=dtype, progress=True)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        chat = messages if getattr(llm.tokenizer, "chat_template", None) else prompt
        if system and chat is prompt:
            _fail("--system needs a model with a chat template")
        stream = llm.generate(chat, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stream=True)
        for piece in stream:
            if not as_json:
                click.echo(piece, nl=False)
                sys.stdout.flush()
    except YirageError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted")
    result = stream.result
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo()
        click.echo(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, "
                   f"ttft {result.prefill_s:.2f} s, decode {result.decode_tokens_per_s:.1f} tokens/s]", err=True)


def main() -> None:
    """Console-script entry point: usage errors are one line too."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted")
    except click.ClickException as e:
        _fail(e.format_message())


if __name__ == "__main__":
    main()
