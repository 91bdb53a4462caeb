"""Plots and the README table, made from benchmarks/results/<device>.json (never by hand).

    python benchmarks/plot.py                          # PNGs for every results file
    python benchmarks/plot.py results.json --config d64
    python benchmarks/plot.py --markdown               # print the markdown table
    python benchmarks/plot.py --readme README.md       # rewrite every generated table of the README
    python benchmarks/plot.py --decode                 # the decode benchmark's PNG (benchmarks/decode.py)

PNGs (next to the JSON): ``<device>-<config>-tflops.png`` (TFLOP/s against T per
implementation; forward and forward+backward, causal and not) and
``<device>-<config>-memory.png`` (compiled temp memory against T). ``--decode``:
``decode-<device>.png`` from ``decode-<device>.json`` (each cell's K/V bandwidth as a share of
HBM, per implementation; one panel per cache kind).

The README's generated tables sit between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers: ``results`` (the sweep of benchmarks/attention.py),
``variants`` (benchmarks/variants.py), ``ring`` (benchmarks/ring.py) and ``train``
(benchmarks/train_lm.py), each from the newest matching JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax.benchmark import load_results as load  # noqa: E402  (the results files of flashjax/benchmark.py)
from flashjax.tuning import device_slug  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Files of other benchmarks, with formats of their own (tables below, no plots).
OTHER_PREFIXES = ("ab-", "kv-check-", "tuning-", "variants-", "ring-", "train_lm-", "decode-", "flex-", "generate-", "gemma-", "persistent-forward-")
# Column order and legend names.
NAMES = {
    "flashjax_mosaic": "flashjax (Pallas Mosaic GPU)",
    "flashjax": "flashjax (Pallas Triton)",
    "cudnn": "cuDNN (jax.nn)",
    "fa3": "FlashAttention-3 (flash-attn3-jax)",
    "tokamax_mosaic": "tokamax mosaic",
    "tokamax_triton": "tokamax triton",
    "pallas_mha": "jax pallas ops mha",
    "torch_fa2": "PyTorch FlashAttention-2",
    "xla": "XLA (jax.nn)",
}


def default_files() -> list[Path]:
    """The results files of benchmarks/attention.py (the other benchmarks' files have other formats)."""
    return sorted(p for p in RESULTS_DIR.glob("*.json") if not p.name.startswith(OTHER_PREFIXES))


def _cells(results: dict, config: str) -> list[dict]:
    return [e for e in results["cells"].values() if e["config"] == config]


def _style(impl: str) -> dict:
    """One colour per implementation in every panel and file; flashjax drawn on top, thicker."""
    import matplotlib.pyplot as plt

    order = list(NAMES) + [impl]
    colour = plt.get_cmap("tab10")(order.index(impl) % 10)
    ours = impl.startswith("flashjax")
    return dict(color=colour, label=NAMES.get(impl, impl), marker="o", linewidth=2.5 if ours else 1.2,
                zorder=3 if ours else 2)


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
                    ax.plot(*zip(*pts), **_style(impl))
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

    # A log axis has no 0: implementations with no temporary buffer sit on a floor line.
    floor_mib = 1e-4
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwdbwd")):
        for impl in _impls(cells):
            pts = sorted((e["seq"], max(e["temp_bytes"] / 2**20, floor_mib)) for e in cells
                         if e["impl"] == impl and e["mode"] == mode and not e["causal"] and e.get("temp_bytes") is not None
                         and e["status"] in ("ok", "mismatch"))
            if pts:
                ax.plot(*zip(*pts), **_style(impl))
        ax.axhline(floor_mib, color="grey", linewidth=0.8, linestyle=":")
        _seq_axis(ax, cells)
        ax.set_yscale("log")
        ax.set_title(f"compiled temp memory, {'forward' if mode == 'fwd' else 'forward + backward'} (not causal)")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("temp MiB (0 on the dotted floor)")
        ax.grid(alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    written.append(out_dir / f"{stem}-{config}-memory.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


DECODE_NAMES = {
    "flashjax": "flashjax (Triton split-KV)",
    "flashjax_mosaic": "flashjax (Hopper)",
    "cudnn": "cuDNN (jax.nn)",
    "fa3": "FA3 flash_mha_with_kvcache",
    "pallas_gqa": "JAX Pallas decode gqa",
    "xla": "XLA",
}
DECODE_PANELS = (("contiguous", "contiguous bf16 cache"), ("paged", "paged bf16 cache (64-key pages)"),
                 ("fp8", "paged float8 cache (its own bytes)"), ("mla", "absorbed-MLA latent cache (576 / 512)"))


# benchmarks/decode.py side runs, not plotted: tile sweeps, the Hopper paged path beside the Triton kernel.
DECODE_SIDE_RUNS = ("decode-configs-", "decode-hopper-paged-")


def decode_files() -> list[Path]:
    """The results files of benchmarks/decode.py (not its side runs, `DECODE_SIDE_RUNS`)."""
    return sorted(p for p in RESULTS_DIR.glob("decode-*.json") if not p.name.startswith(DECODE_SIDE_RUNS))


def plot_decode(path: Path, out_dir: Path | None = None) -> Path | None:
    """Writes ``<stem>.png`` for a benchmarks/decode.py results file: per cache kind, a bar
    per implementation and cell (batch, context), its K/V bytes over the step time as a
    share of the GPU's HBM bandwidth (the issue's 80% line drawn; TB/s where the file
    knows no HBM bandwidth, as without a GPU). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load(path)
    hbm = results.get("hbm_bytes_per_s")
    ok = [e for e in results["cells"].values() if e.get("status") == "ok" and e.get("q_len", 1) == 1]
    panels = [(kind, title) for kind, title in DECODE_PANELS if any(e["cache"] == kind for e in ok)]
    if not panels:
        print(f"{path}: no decode cells with a bandwidth to plot", file=sys.stderr)
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), squeeze=False)
    every = [i for i in DECODE_NAMES if any(e["impl"] == i for e in ok)]  # one colour per implementation
    for ax, (kind, title) in zip(axes[:, 0], panels):
        cells = sorted({(e["batch"], e["context"]) for e in ok if e["cache"] == kind}, key=lambda c: (c[0], c[1]))
        impls = [i for i in every if any(e["impl"] == i and e["cache"] == kind for e in ok)]
        width = 0.8 / len(impls)
        for n, impl in enumerate(impls):
            share = {(e["batch"], e["context"]): 100 * e["tb_per_s"] * 1e12 / hbm if hbm else e["tb_per_s"]
                     for e in ok if e["cache"] == kind and e["impl"] == impl}
            xs = [i + (n - (len(impls) - 1) / 2) * width for i, c in enumerate(cells) if c in share]
            ys = [share[c] for c in cells if c in share]
            if ys:
                style = _style_for(impl, every)
                ax.bar(xs, ys, width, **style)
        ax.set_xticks(range(len(cells)), [f"B={b}, {_seq_label(t)}" for b, t in cells], fontsize=8)
        if hbm:
            ax.axhline(80, color="grey", linewidth=0.8, linestyle="--")
            ax.set_ylim(0, 100)
        ax.set_ylabel("% of HBM bandwidth" if hbm else "TB/s")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle(f"{results.get('device', path.stem)}: one decode step (q_len 1), K/V bytes read / time")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    out = (out_dir or path.parent) / f"{path.stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _style_for(impl: str, impls: list[str]) -> dict:
    import matplotlib.pyplot as plt

    colour = plt.get_cmap("tab10")(impls.index(impl) % 10)
    return dict(color=colour, label=DECODE_NAMES.get(impl, impl), edgecolor="black" if impl.startswith("flashjax") else None,
                linewidth=0.6)


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
    # The cells' own dates (a results file merges runs of several days), else the file's.
    dates = sorted({c["time"][:10] for c in cells if c.get("time")}) or [results.get("date", "?")]
    lines.append("")
    lines.append(f"TFLOP/s, forward / forward+backward: {results.get('device', '?')}, JAX {results.get('jax', '?')}, "
                 f"{', '.join(dates)}; bf16, {_shape_label(e)}, {e['batch'] * e['seq']} tokens per batch. "
                 "Generated by `python benchmarks/plot.py --readme README.md` from the JSON in benchmarks/results/.")
    return "\n".join(lines)


VARIANT_COLUMNS = (("flashjax", "Triton"), ("flashjax_mosaic", "Hopper"), ("cudnn", "cuDNN"),
                   ("fa3", "FlashAttention-3"), ("tokamax", "tokamax"))


def variants_markdown(results: dict) -> str:
    """Variant rows of benchmarks/variants.py: milliseconds of each implementation that a run
    measured, the Hopper kernels over the Triton kernels, and the cost relative to the row's baseline."""
    rows = results["rows"]
    by_name = {(r["variant"], r["seq"], r["batch"]): r for r in rows}
    columns = [(impl, label) for impl, label in VARIANT_COLUMNS if any(r.get(f"{impl}_fwd_ms") for r in rows)]
    hopper = any(impl == "flashjax_mosaic" for impl, _ in columns)
    lines = ["| variant | B × T | useful scores | " + " | ".join(f"{label} fwd / fwd+bwd" for _, label in columns)
             + (" | Hopper / Triton, fwd+bwd" if hopper else "") + " | fastest flashjax vs baseline row |",
             "|---|---|---|" + "---|" * (len(columns) + hopper + 1)]

    def ms(r, impl):
        a, b = r.get(f"{impl}_fwd_ms"), r.get(f"{impl}_fwdbwd_ms")
        if a and b:
            return f"{a:.2f} / {b:.2f}"
        # A peer that was not installed in the row's run is not run, not without the variant.
        missing = "not installed" in str(r.get(f"{impl}_fwd_error", "")) or r.get(f"{impl}_fwd_status") == "unavailable"
        return "not run" if missing else "n/a"

    def vs_baseline(r, base, mode):
        """The faster flashjax backend's time on row r over that same backend's time on `base`."""
        keys = [k for k in (f"flashjax_{mode}_ms", f"flashjax_mosaic_{mode}_ms") if r.get(k) and base.get(k)]
        key = min(keys, key=lambda k: r[k], default=None)
        return None if key is None else r[key] / base[key]

    for r in rows:
        base = by_name.get((r.get("baseline", "full"), r["seq"], r["batch"]))
        ratio = "–"
        if base and base is not r and all(vs_baseline(r, base, m) for m in ("fwd", "fwdbwd")):
            ratio = f"{vs_baseline(r, base, 'fwd'):.2f} / {vs_baseline(r, base, 'fwdbwd'):.2f} of {base['variant']}"
        cells = [ms(r, impl) for impl, _ in columns]
        if hopper:
            a, b = r.get("flashjax_mosaic_fwdbwd_ms"), r.get("flashjax_fwdbwd_ms")
            cells.append(f"{a / b:.2f}" if a and b else "–")
        lines.append(f"| {r['variant']} | {r['batch']} × {_seq_label(r['seq'])} | {r['useful_fraction']:.0%} | "
                     + " | ".join(cells) + f" | {ratio} |")
    e = rows[0]
    # Rows merged from another run (variants.py --merge) carry their own date.
    later = {}
    for r in rows:
        if r.get("date", results["date"]) != results["date"]:
            later.setdefault(r["date"], []).append(r["variant"])
    # Cells re-measured apart from their row carry their own date; named by variant where
    # only some rows' cells were.
    for impl, label in columns:
        redated = {}
        for r in rows:
            if r.get(f"{impl}_date", results["date"]) != results["date"]:
                redated.setdefault(r[f"{impl}_date"], []).append(r["variant"])
        for d, variants in redated.items():
            some = len(variants) < sum(1 for r in rows if r.get(f"{impl}_fwd_ms") is not None)
            later.setdefault(d, []).append(f"{label} cells" + (f" of {', '.join(sorted(set(variants)))}" if some else ""))
    date = results["date"] + "".join(f" ({', '.join(sorted(set(v)))}: {d})" for d, v in sorted(later.items()))
    lines += ["", f"{results['device']}, JAX {results['jax']}, {date}; bf16, H={e['heads']}, D={e['head_dim']}, ms. "
              "The last column: the faster flashjax backend's time over its time on the row's baseline (the unmasked "
              "problem of the same shape), fwd / fwd+bwd; \"not run\": the peer was not installed in that row's run. Generated by `python benchmarks/plot.py --readme README.md`."]
    return "\n".join(lines)


def ring_markdown(results: dict) -> str:
    """benchmarks/ring.py: per-GPU TFLOP/s on one GPU and on the ring, and the scaling efficiency."""
    by = {(e["impl"], e["seq"], e["causal"], e["mode"]): e for e in results["entries"]}
    n = results["devices"]
    lines = [f"| T, causal | 1 GPU fwd / fwd+bwd | ring, {n} GPUs, per GPU | efficiency | speed-up |", "|---|---|---|---|---|"]
    for seq, causal in sorted({(e["seq"], e["causal"]) for e in results["entries"]}):
        def cell(impl, key, fmt):
            vals = [by.get((impl, seq, causal, m), {}).get(key) for m in ("fwd", "fwdbwd")]
            return " / ".join(fmt(v) if v is not None else "–" for v in vals)
        lines.append(f"| {_seq_label(seq)}, {'yes' if causal else 'no'} | {cell('single', 'tflops_per_gpu', '{:.0f}'.format)} | "
                     f"{cell('ring', 'tflops_per_gpu', '{:.0f}'.format)} | {cell('ring', 'efficiency', '{:.0%}'.format)} | "
                     f"{cell('ring', 'speedup', '{:.2f}x'.format)} |")
    e = results["entries"][0]
    reps = sorted({len(x["times"]) for x in results["entries"] if x.get("times")})
    lines += ["", f"TFLOP/s per GPU, forward / forward+backward: {n}x {results['device']}, JAX {results['jax']}, {results['date']}; "
              f"bf16, B=1, H={e['heads']}, D={e['head_dim']}; the median of {'/'.join(map(str, reps))} repetitions a cell; "
              "causal rows use the zig-zag layout. "
              "Generated by `python benchmarks/plot.py --readme README.md`."]
    return "\n".join(lines)


def train_markdown(results: dict) -> str:
    """benchmarks/train_lm.py: tokens/s and peak memory of the example LM, flashjax vs Flax attention."""
    by = {(r["attention"], r["seq"]): r for r in results["rows"]}

    def cell(r):
        if r is None:
            return "–"
        if r["status"] != "ok":
            return r["status"]
        peak = r.get("peak_memory_bytes")
        return f"{r['tokens_per_s'] / 1e3:,.0f}k tok/s, {peak / 2**30:.1f} GiB" if peak else f"{r['tokens_per_s'] / 1e3:,.0f}k tok/s"

    lines = ["| T | batch | flashjax | Flax default attention | speed-up | loss after the last step (flashjax / Flax) |",
             "|---|---|---|---|---|---|"]
    for seq in sorted({r["seq"] for r in results["rows"]}):
        a, b = by.get(("flash", seq)), by.get(("flax", seq))
        ok = a and b and a["status"] == b["status"] == "ok"
        speed = f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if ok else "–"
        loss = f"{a['losses'][-1]:.3f} / {b['losses'][-1]:.3f}" if ok else "–"
        lines.append(f"| {_seq_label(seq)} | {(a or b)['batch']} | {cell(a)} | {cell(b)} | {speed} | {loss} |")
    lines += ["", f"examples/train_lm.py ({results['model']}; flashjax with backend='auto'), {results['tokens_per_step']} tokens per step, the median of "
              f"steps 2-{results['steps']} (the first compiles): {results['device']}, {results['date']}. Generated by `python benchmarks/plot.py --readme README.md`."]
    return "\n".join(lines)


def newest(prefix: str) -> Path | None:
    """The most recently written results file of a benchmark (by name prefix)."""
    files = sorted(RESULTS_DIR.glob(f"{prefix}*.json"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def readme_sections(results_file: Path, config: str) -> dict[str, str]:
    """Every generated README table whose results exist: marker name -> markdown."""
    results = load(results_file)
    sections = {"results": markdown(results, config)}
    # The other head-dim configs the file holds, each under its own markers (results-d256, ...).
    for other in sorted({c["config"] for c in results["cells"].values()} - {config}):
        sections[f"results-{other}"] = markdown(results, other)
    for name, prefix, render in (("variants", "variants-", variants_markdown), ("train", "train_lm-", train_markdown)):
        # The same GPU's file where there is one (mtimes say nothing in a fresh clone).
        same_device = RESULTS_DIR / f"{prefix}{results_file.name}"
        path = same_device if same_device.exists() else newest(prefix)
        if path is not None:
            sections[name] = render(load(path))
    # One ring table per machine measured (2 GPUs, 4 GPUs, ...), fewest GPUs first: the file
    # ring.py writes by default for it (other files, e.g. dated ones, hold separate runs).
    loaded = [(path, load(path)) for path in sorted(RESULTS_DIR.glob("ring-*.json"))]
    default_name = lambda ring: f"ring-{device_slug(f'{ring['device']} x{ring['devices']}')}.json"
    rings = sorted((ring for path, ring in loaded if "devices" in ring and path.name == default_name(ring)),
                   key=lambda r: (r["devices"], r["device"]))
    if rings:
        sections["ring"] = "\n\n".join(ring_markdown(r) for r in rings)
    return sections


def update_readme(readme: Path, sections: dict[str, str]):
    """Replaces what lies between each section's markers in the README (sections without markers are skipped)."""
    content = readme.read_text()
    for name, text in sections.items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if begin not in content or end not in content:
            continue
        head, rest = content.split(begin, 1)
        _, tail = rest.split(end, 1)
        content = f"{head}{begin}\n{text}\n{end}{tail}"
    readme.write_text(content)


def main(argv: list[str] | None = None) -> int:
    """Plots every given (or found) results file; optionally prints or writes the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="results JSON (default: benchmarks/results/*.json)")
    p.add_argument("--config", default="d128", help="d128 | d64 | gqa | d256")
    p.add_argument("--markdown", action="store_true", help="print the markdown table instead of plotting")
    p.add_argument("--readme", type=Path, help="rewrite the generated tables of this README")
    p.add_argument("--out-dir", type=Path, help="where to write the PNGs (default: next to the JSON)")
    p.add_argument("--decode", action="store_true", help="plot benchmarks/decode.py's results (the given or found files)")
    args = p.parse_args(argv)
    if args.decode:
        files = args.files or decode_files()
        written = [plot_decode(f, args.out_dir) for f in files]
        for w in written:
            if w is not None:
                print(w)
        return 0 if any(written) else 1
    files = args.files or default_files()
    if not files:
        print(f"no results in {RESULTS_DIR}; run benchmarks/attention.py first", file=sys.stderr)
        return 1
    if args.readme:
        sections = readme_sections(files[0], args.config)
        update_readme(args.readme, sections)
        print(f"wrote the {', '.join(sections)} tables into {args.readme}")
        return 0
    if args.markdown:
        print("\n\n".join(markdown(load(f), args.config) for f in files))
        return 0
    for f in files:
        for written in plot_file(f, args.config, args.out_dir):
            print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
