"""Plots and the README table, made from benchmarks/results/<device>.json (never by hand).

    python benchmarks/plot.py                          # PNGs for every results file
    python benchmarks/plot.py results.json --config d64
    python benchmarks/plot.py --markdown               # print the markdown table
    python benchmarks/plot.py --readme README.md       # rewrite the table between the markers

PNGs (next to the JSON): ``<device>-<config>-tflops.png`` (TFLOP/s against T per
implementation; forward and forward+backward, causal and not) and
``<device>-<config>-memory.png`` (compiled temp memory against T).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
README_BEGIN = "<!-- results:begin -->"
README_END = "<!-- results:end -->"
# Column order and legend names.
NAMES = {
    "flashjax": "flashjax (Pallas Triton)",
    "cudnn": "cuDNN (jax.nn)",
    "fa3": "FlashAttention-3 (flash-attn3-jax)",
    "tokamax_mosaic": "tokamax mosaic",
    "tokamax_triton": "tokamax triton",
    "pallas_mha": "jax pallas ops mha",
    "torch_fa2": "PyTorch FlashAttention-2",
    "xla": "XLA (jax.nn)",
}


def load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def default_files() -> list[Path]:
    """The results files of benchmarks/attention.py (tuning and variants files have other formats)."""
    return sorted(p for p in RESULTS_DIR.glob("*.json") if not p.name.startswith(("tuning-", "variants-")))


def _cells(results: dict, config: str) -> list[dict]:
    return [e for e in results["cells"].values() if e["config"] == config]


def _impls(cells: list[dict]) -> list[str]:
    present = {e["impl"] for e in cells}
    return [i for i in NAMES if i in present] + sorted(present - set(NAMES))


def plot_file(path: Path, config: str, out_dir: Path | None = None) -> list[Path]:
    """Writes the TFLOP/s and memory PNGs of one results file; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(path)
    cells = _cells(results, config)
    if not cells:
        print(f"{path}: no cells for config {config!r}", file=sys.stderr)
        return []
    out_dir = out_dir or path.parent
    stem = path.stem
    device = results.get("device", stem)
    written = []

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for row, mode in enumerate(("fwd", "fwdbwd")):
        for col, causal in enumerate((False, True)):
            ax = axes[row][col]
            for impl in _impls(cells):
                pts = sorted((e["seq"], e["tflops"]) for e in cells
                             if e["impl"] == impl and e["mode"] == mode and e["causal"] == causal and e["status"] == "ok")
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=NAMES.get(impl, impl),
                            linewidth=2.5 if impl == "flashjax" else 1.2)
            _seq_axis(ax, cells)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}, {'causal' if causal else 'not causal'}")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("sequence length T (16k tokens per batch)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle(f"{device}, bf16, {config} ({_shape_label(cells[0])})")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    written.append(out_dir / f"{stem}-{config}-tflops.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwdbwd")):
        for impl in _impls(cells):
            pts = sorted((e["seq"], e["temp_bytes"] / 2**20) for e in cells
                         if e["impl"] == impl and e["mode"] == mode and not e["causal"] and e.get("temp_bytes"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=NAMES.get(impl, impl))
        _seq_axis(ax, cells)
        ax.set_yscale("log")
        ax.set_title(f"temp memory, {'forward' if mode == 'fwd' else 'forward + backward'} (not causal)")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("MiB (compiled memory analysis)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / f"{stem}-{config}-memory.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _seq_label(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def _seq_axis(ax, cells):
    seqs = sorted({e["seq"] for e in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [_seq_label(t) for t in seqs])
    ax.minorticks_off()


def _shape_label(e: dict) -> str:
    heads = f"H={e['heads']}" + (f", Hkv={e['kv_heads']}" if e["kv_heads"] != e["heads"] else "")
    return f"{heads}, D={e['head_dim']}"


def markdown(results: dict, config: str = "d128") -> str:
    """The README table: rows (T, causal), columns fwd / fwd+bwd TFLOP/s per implementation."""
    cells = _cells(results, config)
    if not cells:
        return f"(no results for {config})"
    impls = _impls(cells)
    by = {(e["seq"], e["causal"], e["mode"], e["impl"]): e for e in cells}

    def val(seq, causal, mode, impl):
        e = by.get((seq, causal, mode, impl))
        if e is None:
            return "–"
        return f"{e['tflops']:.0f}" if e["status"] == "ok" else {"unsupported": "n/a", "unavailable": "n/a"}.get(e["status"], e["status"])

    lines = ["| T, causal | " + " | ".join(NAMES.get(i, i) for i in impls) + " |",
             "|---|" + "---|" * len(impls)]
    for seq, causal in sorted({(e["seq"], e["causal"]) for e in cells}):
        vals = [f"{val(seq, causal, 'fwd', i)} / {val(seq, causal, 'fwdbwd', i)}" for i in impls]
        lines.append(f"| {_seq_label(seq)}, {'yes' if causal else 'no'} | " + " | ".join(vals) + " |")
    e = cells[0]
    lines.append("")
    lines.append(f"TFLOP/s, forward / forward+backward: {results.get('device', '?')}, JAX {results.get('jax', '?')}, "
                 f"{results.get('date', '?')}; bf16, {_shape_label(e)}, {e['batch'] * e['seq']} tokens per batch. "
                 "Generated by `python benchmarks/plot.py --readme README.md` from the JSON in benchmarks/results/.")
    return "\n".join(lines)


def update_readme(readme: Path, text: str):
    """Replaces what lies between the results markers of the README with `text`."""
    content = readme.read_text()
    if README_BEGIN not in content or README_END not in content:
        raise SystemExit(f"{readme} has no {README_BEGIN} ... {README_END} markers")
    head, rest = content.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{text}\n{README_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    """Plots every given (or found) results file; optionally prints or writes the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="results JSON (default: benchmarks/results/*.json)")
    p.add_argument("--config", default="d128", help="d128 | d64 | gqa | d256")
    p.add_argument("--markdown", action="store_true", help="print the markdown table instead of plotting")
    p.add_argument("--readme", type=Path, help="write the table of the first file into this README")
    p.add_argument("--out-dir", type=Path, help="where to write the PNGs (default: next to the JSON)")
    args = p.parse_args(argv)
    files = args.files or default_files()
    if not files:
        print(f"no results in {RESULTS_DIR}; run benchmarks/attention.py first", file=sys.stderr)
        return 1
    if args.markdown or args.readme:
        sections = [markdown(load(f), args.config) for f in files]
        if args.readme:
            update_readme(args.readme, sections[0])
            print(f"wrote the {args.config} table of {files[0]} into {args.readme}")
        else:
            print("\n\n".join(sections))
        return 0
    for f in files:
        for written in plot_file(f, args.config, args.out_dir):
            print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
