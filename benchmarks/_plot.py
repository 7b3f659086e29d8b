"""The benchmarks' figures: yirage's ratio against each peer as bars, the machine in the title.

Every benchmark script with sides takes ``--plot PATH.png`` (``add_plot_option``): after its JSON
it turns its report into a *figure* (a small JSON-ready dict, ``figure``) and draws it with
matplotlib (``save``), writing ``PATH.png`` and, beside it, ``PATH.json`` (the figure: the data,
the machine, the date and the command), so the picture can be drawn again without rerunning::

    python benchmarks/_plot.py docs/img/benchmarks/decode.json            # -> decode.png
    python benchmarks/_plot.py FIGURE.json -o OTHER.png

A figure::

    {"job": "decode", "title": "SmolLM2-135M decode and prefill vs llama.cpp",
     "ylabel": "yirage / peer tokens/s (higher: yirage faster)",
     "machine": {...machine_record() or the fields known of a recorded run...},
     "date": "2026-11-27", "command": "python benchmarks/decode.py ...",
     "source": "measured" | "redrawn from README.md's table of 2026-11-27",
     "bars": [{"group": "decode, 42-token prompt", "series": "float32 vs llama.cpp", "ratio": 2.08}, ...]}

Groups lie along the x axis, one bar per series in each group, a dashed line at 1.0x; every bar
is labelled with its ratio; the y axis turns logarithmic (base 2, bars drawn from 1x) when the ratios
span more than 8x. The style follows ``yirage benchmark --plot``
(``yirage.tools.benchmark.plot_speedups``: matplotlib's ``Figure`` without pyplot, so no display
is needed). Needs matplotlib (the ``bench`` and ``test`` extras).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

#: the ISA levels named in a title, best first: (label, flags that must all be present)
_ISA_LEVELS = (("AVX-512", ("avx512f", "avx512bw")), ("AVX2", ("avx2", "fma")), ("NEON", ("neon",)),
               ("NEON", ("asimd",)))
#: extensions named after the level when present
_ISA_EXTRAS = (("BF16", "avx512_bf16"), ("VNNI", "avx512_vnni"), ("AVX-VNNI", "avx_vnni"), ("AMX", "amx_tile"),
               ("dotprod", "asimddp"))


#: the image formats --plot takes (matplotlib's, by suffix)
FORMATS = (".png", ".svg", ".pdf")


def _plot_path(value: str) -> str:
    """--plot's argparse type: an image path of a known format in an existing directory, checked
    before the benchmark runs rather than after."""
    stem, suffix = os.path.splitext(value)
    if suffix.lower() not in FORMATS:
        raise argparse.ArgumentTypeError(f"{value!r}: the figure's suffix picks its format, one of {', '.join(FORMATS)}")
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{value!r}: the folder {folder} does not exist")
    return value


def add_plot_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--plot PATH.png`` to a benchmark's parser."""
    ap.add_argument("--plot", metavar="PATH.png", default=None, type=_plot_path,
                    help="also draw yirage's ratio against each peer into PATH.png (and the figure's data "
                         "into PATH.json beside it; needs matplotlib)")


def check_plot(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A parser error when --plot's data file (PATH.json) would overwrite -o's report."""
    output = getattr(args, "output", None)
    if args.plot and output and os.path.abspath(data_path(args.plot)) == os.path.abspath(output):
        ap.error(f"--plot {args.plot} writes its data to {data_path(args.plot)}, which is -o's report: "
                 "name the figure otherwise")


def data_path(plot: str) -> str:
    """Where --plot PATH.png writes its figure's data: PATH.json."""
    return os.path.splitext(plot)[0] + ".json"


def command_line() -> str:
    """The command that is running, as a reader would type it (``python benchmarks/x.py ...``)."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd()) if sys.argv and sys.argv[0] else "?"
    return shlex.join(["python", script, *sys.argv[1:]])


def isa_summary(machine: dict) -> str:
    """The ISA level of a machine record in a few words: 'AVX-512 (BF16, VNNI, AVX-VNNI)',
    'AVX2', 'NEON (dotprod)' ..., and the cap when ``YIRAGE_ISA`` set one."""
    flags = set(machine.get("isa") or ())
    level = next((name for name, need in _ISA_LEVELS if set(need) <= flags), "scalar")
    extras = [name for name, flag in _ISA_EXTRAS if flag in flags and not (name == "AMX" and not machine.get("amx"))]
    text = level + (f" ({', '.join(extras)})" if extras else "")
    if machine.get("amx") and "AMX" not in extras:
        text += ", AMX"
    cap = machine.get("isa_cap")
    if cap and cap != "native":
        text += f", capped to {cap}"
    return text


def machine_summary(machine: dict) -> str:
    """'AMD EPYC (x86 family 26 model 2), AVX-512 (BF16, VNNI), 2 cores, 2 threads'."""
    cpu = machine.get("cpu") or "unknown CPU"
    gen = machine.get("cpu_generation")
    if gen and "/" in str(gen):
        fam, model = str(gen).split("/", 1)
        cpu += f" (x86 family {fam} model {model})"
    elif gen:
        cpu += f" ({gen})"
    parts = [cpu, isa_summary(machine)]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} core{'s' if machine['cores'] != 1 else ''}")
    if machine.get("threads"):
        parts.append(f"{machine['threads']} thread{'s' if machine['threads'] != 1 else ''}")
    if machine.get("gpu"):
        parts.append(str(machine["gpu"]))
    return ", ".join(parts)


def figure(job: str, title: str, machine: dict, bars: list[dict], *, ylabel: str | None = None,
           command: str | None = None, date: str | None = None, source: str = "measured",
           notes: str | None = None) -> dict:
    """A figure dict (see the module's docstring); ``command`` defaults to this process's command
    line and ``date`` to today (UTC). Bars without a ratio (a side that failed) are dropped."""
    fig = {"job": job, "title": title,
           "ylabel": ylabel or "yirage's speedup over the peer (x; higher: yirage faster)",
           "machine": machine, "date": date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
           "command": command or command_line(), "source": source,
           "bars": [{**b, "ratio": round(float(b["ratio"]), 4)} for b in bars if b.get("ratio")]}
    if notes:
        fig["notes"] = notes
    return fig


def title_of(fig: dict) -> str:
    """The figure's title: what, then the machine and the date (and 'redrawn' for a recorded run)."""
    when = fig["date"] + ("" if fig.get("source", "measured") == "measured" else ", redrawn from the recorded run")
    return f"{fig['title']}\n{machine_summary(fig['machine'])}\n{when}"


def draw(fig: dict, path: str, dpi: int = 100) -> str:
    """Draw ``fig`` into ``path`` (its suffix picks the format); returns ``path``."""
    render(fig).savefig(path, dpi=dpi, bbox_inches="tight")
    return str(path)


def render(fig: dict):
    """``fig`` as a ``matplotlib.figure.Figure`` (not saved)."""
    from matplotlib.figure import Figure

    bars = fig["bars"]
    groups = list(dict.fromkeys(b["group"] for b in bars))
    series = list(dict.fromkeys(b["series"] for b in bars))
    # each group's bars side by side, centred on the group: only the series present in it
    present = {g: [s for s in series if any(b["group"] == g and b["series"] == s for b in bars)] for g in groups}
    width = 0.8 / max([1] + [len(p) for p in present.values()])
    fig_width = min(14.0, max(6.5, 0.35 * len(bars) + 0.6 * len(groups) + 2))
    out = Figure(figsize=(fig_width, 4.8))
    ax = out.subplots()
    ratios = [b["ratio"] for b in bars] + [1.0]
    log = max(ratios) / min(ratios) > 8   # ratios far apart (a slow reference): a log axis, bars from 1x
    for s in series:
        mine = [b for b in bars if b["series"] == s]
        xs = [groups.index(b["group"]) + (present[b["group"]].index(s) - (len(present[b["group"]]) - 1) / 2) * width
              for b in mine]
        if log:
            drawn = ax.bar(xs, [b["ratio"] - 1 for b in mine], width, bottom=1, label=s)
        else:
            drawn = ax.bar(xs, [b["ratio"] for b in mine], width, label=s)
        ax.bar_label(drawn, labels=[f"{b['ratio']:.2f}" for b in mine], fontsize=6, padding=1)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    # crowded: many groups, or a label wider than its group's slot (7-pt text: ~4.5 px a character
    # at 100 dpi over ~80% of the figure's width)
    slot_chars = 0.8 * fig_width * 100 / max(1, len(groups)) / 4.5
    crowded = len(groups) > 6 or max((len(g) for g in groups), default=0) > slot_chars
    ax.set_xticks(range(len(groups)), groups, fontsize=7, rotation=30 if crowded else 0,
                  ha="right" if crowded else "center")
    ax.set_ylabel(fig.get("ylabel", "speedup (x)"), fontsize=8)
    if log:
        ax.set_yscale("log", base=2)
        ax.set_ylim(min(ratios) / 1.5, max(ratios) * 1.5)
        ax.yaxis.set_major_formatter(lambda v, _: f"{v:.3g}x")
    else:
        ax.set_ylim(0, max(ratios) * 1.15)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title_of(fig) + ("" if bars else "\n(no ratio to draw: every peer failed or was skipped)"),
                 fontsize=8)
    if series:   # below the axes, where it hides no bar
        ax.legend(fontsize=7, ncols=min(3, len(series)), loc="upper center", frameon=False,
                  bbox_to_anchor=(0.5, -0.22 if crowded else -0.08))
    return out


def save(fig: dict | None, path: str) -> None:
    """Draw ``fig`` into ``path`` and write it as JSON beside it (``path`` with .json); a note on
    stderr instead when the run has nothing to compare (``fig`` None)."""
    if fig is None:
        print(f"[plot] nothing to draw into {path}: this run has no peer to compare yirage with", file=sys.stderr)
        return
    stem = os.path.splitext(path)[0]
    with open(data_path(path), "w", encoding="utf-8") as f:
        json.dump(fig, f, indent=1)
        f.write("\n")
    try:
        draw(fig, path)
    except ImportError:
        print(f"[plot] matplotlib is not installed: the figure's data is in {stem}.json; pip install matplotlib, "
              f"then python benchmarks/_plot.py {stem}.json", file=sys.stderr)
        return
    print(f"[plot] {path} (data: {stem}.json)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="draw a benchmark figure from its JSON (benchmarks/_plot.py)")
    ap.add_argument("figure", help="a figure JSON (written by a benchmark's --plot, or by hand)")
    ap.add_argument("-o", "--output", default=None, help="the image (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    with open(args.figure, encoding="utf-8") as f:
        fig = json.load(f)
    out = args.output or os.path.splitext(args.figure)[0] + ".png"
    draw(fig, out)
    print(out)


if __name__ == "__main__":
    main()
