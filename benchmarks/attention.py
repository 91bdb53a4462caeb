"""The attention benchmark: flashjax against its peers, one process, one run.

    python benchmarks/attention.py                       # the standard sweep
    python benchmarks/attention.py --seqlens 1024,4096,16384 --configs d128,gqa \\
        --modes fwd,fwdbwd --causal both --impls flashjax,cudnn,pallas_mha
    python benchmarks/attention.py --impls flashjax_mosaic --mosaic-config bwd_stages=3 \\
        --out /tmp/bwd_stages3.json                      # a non-default MosaicConfig, in its own file
    python benchmarks/attention.py --impls flashjax_mosaic --ab flashjax_mosaic:bwd_stages=3 \\
        --out /tmp/ab.json                               # default and variant, interleaved rounds
    python benchmarks/attention.py --smoke --out /tmp/bench   # CPU: tiny, interpret mode

The protocol is the one of `flashjax.benchmark` (its module docstring): bfloat16,
16384 tokens per batch (B = 16384 // T); FLOPs 4*B*H*Tq*Tk*D for the forward, halved
when causal, and 3.5x that for forward+backward (jax.grad of sum(out * cotangent)
w.r.t. q, k, v). Each cell is compiled once (the compiled executable gives the memory
analysis and is what is timed), checked against `flashjax.reference` on the last
query rows of batch row 0 (the output, or dq for forward+backward), warmed up twice,
then timed as the median of >= 10 repetitions of a few back-to-back calls ended by
`block_until_ready`. A peer that fails is recorded with its error, never a crash.

`flashjax` is flash_attention(backend="triton") and `flashjax_mosaic` is
backend="mosaic" (the Hopper kernels), each with its backend's tuned config;
`--triton-config fwd.block_k=64,dq.num_warps=4` and `--mosaic-config
bwd_stages=3,stages=3` override fields of that config (for every head dim of
the sweep). Cells with overrides keep their usual keys, so such a run needs `--out`.
To compare two configs, measure them in one process: `--ab flashjax_mosaic:fwd_persistent=false`
adds the implementation `flashjax_mosaic~ab` (the impl's config with those overrides on
top), and every cell of a row is then timed in `--rounds` interleaved rounds (default 3),
the median round kept: a single timing of one cell moves by 5-10% from run to run on an
H100 (clocks, the GPU of the pool), more than most config changes are worth.

Results are merged into benchmarks/results/<device>.json (cells keyed by config, T,
causal, mode and implementation), so a sweep may be run in pieces (`--resume` skips
cells already measured). PyTorch's FlashAttention-2 runs in a subprocess
(benchmarks/torch_sdpa.py) before JAX touches the GPU: both frameworks grab GPU memory
up front, and running torch first lets JAX keep its default preallocation, so XLA's
out-of-memory cells are those of a normal JAX process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax.benchmark import (  # noqa: E402  (the protocol: flashjax/benchmark.py)
    CHECK_ROWS,
    MODES,
    TOKENS,
    TOLERANCE,
    Cell,
    Checker,
    causal_values,
    cell_key,
    compile_cell,
    config_overrides,
    is_oom,
    load_results,
    make_inputs,
    median_time,
    parse_list,
    parse_seq,
    problems,
    record,
    results_path,
    save_results,
    short_error,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# name -> (heads, kv_heads, head_dim); H * D = 2048 except head dim 256 (H = 8).
CONFIGS = {
    "d128": (16, 16, 128),
    "d64": (32, 32, 64),
    "gqa": (32, 8, 128),
    "d256": (8, 8, 256),
}
SMOKE_CONFIGS = {"smoke": (2, 1, 32)}
IMPLS = ("flashjax", "flashjax_mosaic", "cudnn", "xla", "pallas_mha", "tokamax_mosaic", "tokamax_triton", "fa3", "torch_fa2")
XLA_SCORE_LIMIT = 40e9  # bytes of materialised scores beyond which XLA is marked "oom" unrun


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Command-line flags, shared by this benchmark and benchmarks/torch_sdpa.py."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="e.g. 1024,4096,16k")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--modes", default=",".join(MODES), help="fwd,fwdbwd")
    p.add_argument("--causal", default="both", help="both | yes | no")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--triton-config", default="", metavar="FIELD=VALUE,...",
                   help="TritonConfig overrides for the flashjax impl, e.g. fwd.block_k=64,dkv.num_warps=4")
    p.add_argument("--mosaic-config", default="", metavar="FIELD=VALUE,...",
                   help="MosaicConfig overrides for the flashjax_mosaic impl, e.g. bwd_stages=3,stages=3")
    p.add_argument("--ab", default="", metavar="IMPL:FIELD=VALUE,...",
                   help="also measure IMPL (flashjax or flashjax_mosaic) with these config overrides, as IMPL~ab, "
                        "interleaved with the other cells of each row (needs --out)")
    p.add_argument("--rounds", type=int, default=None,
                   help="time each row's cells in this many interleaved rounds, the median round kept "
                        "(default 3 with --ab, else 1)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (>= 10 for the protocol)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per batch (B = tokens // T)")
    p.add_argument("--out", default=None, help="results directory or .json file (default benchmarks/results/)")
    p.add_argument("--fresh", action="store_true", help="do not merge into an existing results file")
    p.add_argument("--resume", action="store_true", help="skip cells already measured (status ok) in the results file")
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting new rows after this many seconds")
    p.add_argument("--compile-workers", type=int, default=4, help="threads compiling one row's cells ahead of timing")
    p.add_argument("--cache-dir", default=None, help="JAX persistent compilation cache (speeds up re-runs)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                   help="run PyTorch FlashAttention-2 in a subprocess (auto: if torch imports and a GPU is present)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized run of every code path (T=128,256, 2 reps)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def plan(args) -> list[Cell]:
    """Cells of the sweep, ordered so the cells that matter most (D=128) run first under a budget."""
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    names = list(configs) if args.smoke else parse_list(args.configs, CONFIGS, "config")
    seqlens = [128, 256] if args.smoke else parse_list(args.seqlens, None, "seqlen", parse_seq)
    modes = parse_list(args.modes, MODES, "mode")
    impls = parse_list(args.impls, IMPLS, "implementation")
    tokens = 256 if args.smoke else args.tokens
    ab_impl = ab_split(args.ab)[0]
    cells = []
    for name in names:
        heads, kv_heads, head_dim = configs[name]
        for seq in seqlens:
            for causal in causal_values(args.causal):
                for mode in modes:
                    for impl in impls:
                        cells.append(Cell(name, heads, kv_heads, head_dim, seq, causal, mode, impl, tokens))
                        if impl == ab_impl:
                            cells.append(Cell(name, heads, kv_heads, head_dim, seq, causal, mode, impl + AB, tokens))
    return cells


# The suffix of the implementation `--ab` adds: its base impl with the --ab overrides.
AB = "~ab"


def ab_split(text: str) -> tuple[str | None, str]:
    """``"IMPL:FIELD=VALUE,..."`` -> (IMPL, overrides); (None, "") without --ab."""
    if not text:
        return None, ""
    impl, sep, fields = text.partition(":")
    if not sep or impl not in FLASHJAX_BACKENDS or not fields.strip():
        raise SystemExit(f"--ab {text!r}: expected IMPL:FIELD=VALUE,... with IMPL one of {sorted(FLASHJAX_BACKENDS)}")
    return impl, fields


# ---- the implementations (JAX) -----------------------------------------------------------
class Unsupported(Exception):
    """A cell an implementation cannot run by design (recorded as 'unsupported')."""


class EstimatedOOM(Exception):
    """A cell whose materialised scores would not fit (recorded as 'oom', not run)."""


def _interpret() -> bool:
    import jax

    return jax.default_backend() != "gpu"


# flashjax's implementations: impl -> (backend, the flag that overrides its config).
FLASHJAX_BACKENDS = {"flashjax": ("triton", "triton_config"), "flashjax_mosaic": ("mosaic", "mosaic_config")}


def override_texts(impl: str, overrides: dict | None) -> list[str]:
    """The ``"field=value,..."`` overrides an impl runs with, in the order they apply: its
    own, or for an `--ab` variant its base impl's and then the variant's (empty ones left out)."""
    return [text for i in dict.fromkeys((impl.removesuffix(AB), impl)) if (text := (overrides or {}).get(i, ""))]


def flashjax_config(impl: str, head_dim: int, overrides: dict | None):
    """The config a flashjax impl (or its `--ab` variant, ``impl~ab``) runs with: None (the
    backend's tuned default), or that default with the impl's ``"field=value,..."`` overrides
    applied (the variant's after its base impl's)."""
    base = impl.removesuffix(AB)
    texts = override_texts(impl, overrides)
    if not texts:
        return None
    import jax.numpy as jnp

    from flashjax import MosaicConfig, TritonConfig

    config = TritonConfig.default(head_dim, jnp.bfloat16) if base == "flashjax" else MosaicConfig.default(head_dim)
    for text in texts:
        config = config_overrides(config, text)
    return config


def impl_fn(cell: Cell, overrides: dict | None = None):
    """(fn, note): fn(q, k, v) -> out [B, T, H, D] for the cell's implementation.

    `overrides`: {impl: "field=value,..."} for the flashjax impls' configs.
    """
    import jax
    import jax.numpy as jnp

    causal, scale = cell.causal, cell.scale
    base = cell.impl.removesuffix(AB)
    if base in FLASHJAX_BACKENDS:
        import flashjax

        backend = FLASHJAX_BACKENDS[base][0]
        config = flashjax_config(cell.impl, cell.head_dim, overrides)
        q = jax.ShapeDtypeStruct((cell.batch, cell.seq, cell.heads, cell.head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((cell.batch, cell.seq, cell.kv_heads, cell.head_dim), jnp.bfloat16)
        try:  # the backend's own reasons when it cannot run the cell (e.g. no sm90 GPU for mosaic)
            choice = flashjax.explain(q, kv, kv, causal=causal, scale=scale, backend=backend, config=config)
        except NotImplementedError as e:  # "backend=... cannot run this call: REASONS. Use backend='auto' ..."
            raise Unsupported(str(e).split("cannot run this call: ", 1)[-1].split(". Use backend=", 1)[0]) from None
        moved = cell.mode == "fwdbwd" and choice.backward_backend != choice.backend
        note = f"backward on {choice.backward_backend}" if moved else ""
        return (lambda q, k, v: flashjax.flash_attention(
            q, k, v, causal=causal, scale=scale, backend=backend, config=config)), note
    if cell.impl in ("cudnn", "xla"):
        if cell.impl == "xla":
            scores = cell.batch * cell.heads * cell.seq * cell.seq
            # logits (bf16) and probabilities (f32) forward; twice that live in the backward.
            need = scores * (6 if cell.mode == "fwd" else 12)
            if need > XLA_SCORE_LIMIT:
                raise EstimatedOOM(f"scores need ~{need / 1e9:.0f} GB")
        return (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation=cell.impl)), ""
    if cell.impl == "pallas_mha":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        if cell.seq % 128:
            raise Unsupported("needs T % 128 == 0 (default 128-row blocks)")
        group = cell.heads // cell.kv_heads
        note = f"K/V repeated x{group} (inside the timed function): the op needs equal heads" if group > 1 else ""
        interpret = _interpret()

        def fn(q, k, v):
            if group > 1:
                k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            return pallas_attention.mha(q, k, v, None, sm_scale=scale, causal=causal, interpret=interpret)

        return fn, note
    if cell.impl.startswith("tokamax_"):
        import tokamax

        implementation = cell.impl.split("_", 1)[1]
        return (lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation)), ""
    if cell.impl == "fa3":
        import flash_attn3_jax

        return (lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, softmax_scale=float(scale), is_causal=causal)), ""
    raise Unsupported(f"{cell.impl} is not a JAX implementation")


def prepare_cell(cell: Cell, args, overrides: dict | None = None):
    """(compiled, note, temp_bytes) of the cell's implementation: compiled once, for the
    memory analysis and the timing."""
    fn, note = impl_fn(cell, overrides)
    compiled, temp = compile_cell(cell, fn, args)
    return compiled, note, temp


def run_row(cells: list[Cell], compile_workers: int, checker: Checker, reps: int, memory_limit,
            overrides: dict | None = None, rounds: int = 1) -> list[dict]:
    """Compiles a row's cells (same problem) concurrently, checks them one by one, then times
    those that passed in `rounds` rounds, each round timing every cell once in turn; a cell
    keeps its median round (with `rounds` > 1 its rounds' medians are recorded too)."""
    import jax

    q, k, v, do = make_inputs(cells[0])
    args = (q, k, v, do)
    prepared = {}

    def prepare(cell):
        try:
            return cell, prepare_cell(cell, args, overrides), None
        except Exception as e:  # recorded below; a peer never stops the sweep
            return cell, None, e

    workers = max(1, compile_workers)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for cell, compiled, error in pool.map(prepare, cells):
            prepared[cell] = (compiled, error)

    entries, checked = [], []
    for cell in cells:
        compiled, error = prepared[cell]
        if error is not None and workers > 1 and not isinstance(error, (Unsupported, EstimatedOOM, ImportError)):
            try:  # concurrent compilation is a speed-up, never a cause of failure: retry alone
                compiled, error = prepare_cell(cell, args, overrides), None
            except Exception as e:
                error = e
        if isinstance(error, Unsupported):
            entries.append(record(cell, "unsupported", error=str(error)))
            continue
        if isinstance(error, EstimatedOOM):
            entries.append(record(cell, "oom", error=str(error)))
            continue
        if isinstance(error, ImportError):
            entries.append(record(cell, "unavailable", error=short_error(error)))
            continue
        if error is not None:
            entries.append(record(cell, "oom" if is_oom(error) else "error", error=short_error(error)))
            continue
        executable, note, temp = compiled
        fields = dict(temp_bytes=temp, note=note)
        if applied := override_texts(cell.impl, overrides):
            fields["config_overrides"] = ",".join(applied)
        if temp is not None and memory_limit and temp > memory_limit:
            entries.append(record(cell, "oom", error=f"temp {temp / 1e9:.1f} GB > device limit", **fields))
            continue
        try:
            result = executable(*args)
            errs = checker.check(cell, result, *args)
            fields["rel_err"] = errs
            del result
            if not all(e < TOLERANCE for e in errs.values()):  # nan fails too
                entries.append(record(cell, "mismatch", error=f"rel err {errs} >= {TOLERANCE}", **fields))
                continue
        except Exception as e:
            entries.append(record(cell, "oom" if is_oom(e) else "error", error=short_error(e), **fields))
            continue
        checked.append((cell, executable, fields))

    timings = {cell: [] for cell, _, _ in checked}
    failed = {}
    for _ in range(rounds):
        for cell, executable, _ in checked:
            if cell not in failed:
                try:
                    timings[cell].append(median_time(lambda: executable(*args), jax.block_until_ready, reps=reps))
                except Exception as e:
                    failed[cell] = e
    for cell, _, fields in checked:
        if cell in failed:
            entries.append(record(cell, "oom" if is_oom(failed[cell]) else "error", error=short_error(failed[cell]),
                                  **fields))
            continue
        medians = [median for median, _, _ in timings[cell]]
        median, times, inner = timings[cell][sorted(range(rounds), key=medians.__getitem__)[(rounds - 1) // 2]]
        if rounds > 1:
            fields["rounds_ms"] = [m * 1e3 for m in medians]
        entries.append(record(cell, "ok", median_ms=median * 1e3, reps_ms=[t * 1e3 for t in times], inner=inner,
                              **fields))
    return entries


def device_memory_limit():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
        return stats.get("bytes_limit")
    except Exception:
        return None


# ---- PyTorch, in its own process ----------------------------------------------------------
def torch_wanted(args) -> bool:
    if "torch_fa2" not in parse_list(args.impls, IMPLS, "implementation"):
        return False
    if args.torch != "auto":
        return args.torch == "on"
    if args.smoke:
        return False
    if importlib.util.find_spec("torch") is None:
        return False
    try:  # cheap GPU probe that does not initialise any framework in this process
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except Exception:
        return False


def run_torch(argv: list[str], budget_s: float) -> tuple[dict, str]:
    """Runs benchmarks/torch_sdpa.py with the same flags; returns (cells by key, device name)."""
    script = Path(__file__).resolve().parent / "torch_sdpa.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torch.json"
        cmd = [sys.executable, str(script), *argv, "--json", str(out), "--budget-s", str(budget_s)]
        proc = subprocess.run(cmd, text=True, stdout=subprocess.DEVNULL)  # progress goes to stderr
        if not out.exists():
            return {}, f"torch subprocess failed (rc={proc.returncode})"
        with open(out) as f:
            data = json.load(f)
    return data.get("cells", {}), data.get("device", "")


def strip_torch_flags(argv: list[str]) -> list[str]:
    """The flags torch_sdpa.py understands: everything but JAX-only ones."""
    drop_with_value = {"--out", "--compile-workers", "--cache-dir", "--torch", "--budget-s", "--ab", "--rounds"}
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in a
            continue
        if name in ("--fresh", "--resume"):
            continue
        kept.append(a)
    return kept


# ---- the report ---------------------------------------------------------------------------
def table(cells: dict, impls: list[str] | None = None) -> str:
    """Compact text table: rows (config, T, causal), columns fwd / fwd+bwd TFLOP/s per impl."""
    entries = list(cells.values())
    if not entries:
        return "(no cells)"
    present = {e["impl"] for e in entries}
    impls = [v for i in (impls or IMPLS) for v in (i, i + AB) if v in present]
    rows = sorted({(e["config"], e["seq"], e["causal"]) for e in entries},
                  key=lambda r: (list(CONFIGS).index(r[0]) if r[0] in CONFIGS else 99, r[1], r[2]))
    by_key = {(e["config"], e["seq"], e["causal"], e["mode"], e["impl"]): e for e in entries}

    def val(row, mode, impl):
        e = by_key.get((*row, mode, impl))
        if e is None:
            return "-"
        if e["status"] == "ok":
            return f"{e['tflops']:.0f}" if e["tflops"] >= 10 else f"{e['tflops']:.2g}"
        return STATUS_MARK.get(e["status"], e["status"])

    def ratio(row, mode, other, base="flashjax"):
        a, b = by_key.get((*row, mode, base)), by_key.get((*row, mode, other))
        if a and b and a["status"] == b["status"] == "ok":
            return f"{b['median_ms'] / a['median_ms']:.2f}"
        return "-"

    header = ["config", "T", "causal"] + impls
    speedups = [("flashjax", o) for o in ("pallas_mha", "cudnn") if o in impls and "flashjax" in impls]
    speedups += [(i, i + AB) for i in IMPLS if i + AB in impls and i in impls]
    header += [f"{o} / {base}" if o.endswith(AB) else f"vs {o}" for base, o in speedups]
    lines = [header]
    for row in rows:
        line = [row[0], str(row[1]), "yes" if row[2] else "no"]
        line += [f"{val(row, 'fwd', i)}/{val(row, 'fwdbwd', i)}" for i in impls]
        line += [f"{ratio(row, 'fwd', o, base)}/{ratio(row, 'fwdbwd', o, base)}" for base, o in speedups]
        lines.append(line)
    widths = [max(len(l[c]) for l in lines) for c in range(len(header))]
    text = ["  ".join(s.rjust(w) for s, w in zip(l, widths)) for l in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    note = ("TFLOP/s fwd/fwd+bwd; vs <peer> = peer time / flashjax time (fwd/fwd+bwd, > 1: flashjax faster); "
            f"<impl>{AB} / <impl> = the --ab variant's time / the impl's (< 1: the variant faster)")
    return "\n".join(text + [note])


# How a cell that was not measured shows in the table.
STATUS_MARK = {"unsupported": "n/a", "unavailable": "n/a", "error": "err", "mismatch": "MISMATCH", "oom": "oom", "skipped": "skip"}


# ---- main -----------------------------------------------------------------------------
def config_flags(args, cells: list[Cell]) -> dict:
    """{impl: overrides} of --triton-config / --mosaic-config, checked on every head dim of
    the sweep before anything runs (a typo stops here, not as error cells)."""
    overrides = {impl: getattr(args, flag) for impl, (_, flag) in FLASHJAX_BACKENDS.items() if getattr(args, flag)}
    if overrides and args.out is None:
        raise SystemExit("--triton-config/--mosaic-config measure a non-default config under the usual cell keys: "
                         "pass --out so that benchmarks/results/<device>.json keeps the defaults' measurements")
    ab_impl, ab_fields = ab_split(args.ab)
    if ab_impl is not None:
        if args.out is None:
            raise SystemExit("--ab measures config variants: pass --out so that benchmarks/results/<device>.json "
                             "keeps the sweep's measurements")
        overrides[ab_impl + AB] = ab_fields
    for impl in overrides:
        for head_dim in sorted({c.head_dim for c in cells if c.impl == impl}):
            try:
                flashjax_config(impl, head_dim, overrides)
            except (ValueError, TypeError) as e:
                flag = "--ab" if impl.endswith(AB) else "--" + FLASHJAX_BACKENDS[impl][1].replace("_", "-")
                raise SystemExit(f"{flag} {overrides[impl]!r} at head_dim {head_dim}: {e}") from None
    return overrides


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Runs the sweep the flags describe, prints the table and writes the results JSON.

    `prog`: the command name shown in --help (``flashjax bench`` runs this main).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.smoke:
        ignored = [f"--{name}" for name in ("configs", "seqlens", "tokens") if getattr(args, name) != parser.get_default(name)]
        if ignored:
            parser.error(f"--smoke runs its own tiny problem: {', '.join(ignored)} would be ignored")
        args.reps = min(args.reps, 2)
    start = time.perf_counter()
    cells = plan(args)
    overrides = config_flags(args, cells)
    rounds = args.rounds or (3 if args.ab else 1)
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")

    # PyTorch first, while JAX has not yet claimed the GPU (see the module docstring).
    torch_cells, torch_note = {}, ""
    if torch_wanted(args):
        print("PyTorch FlashAttention-2 (subprocess) ...", flush=True)
        torch_cells, torch_note = run_torch(strip_torch_flags(argv), budget_s=args.budget_s * 0.15)
        if not torch_cells:  # the subprocess failed: its cells are recorded as such, with the reason
            torch_cells = {c.key: record(c, "error", error=torch_note) for c in cells if c.impl == "torch_fa2"}
    cells = [c for c in cells if c.impl != "torch_fa2"]

    import jax

    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    device = jax.devices()[0].device_kind
    path = results_path(RESULTS_DIR, args.out, device, smoke=args.smoke)
    results = {"cells": {}} if args.fresh else load_results(path)
    import flashjax

    results.update(
        device=device, platform=jax.default_backend(), jax=jax.__version__, flashjax=flashjax.__version__,
        date=datetime.date.today().isoformat(),
        protocol=dict(tokens=256 if args.smoke else args.tokens, dtype="bfloat16", reps=args.reps, check_rows=CHECK_ROWS, tolerance=TOLERANCE,
                      flops="4*B*H*Tq*Tk*D fwd, /2 causal, x3.5 fwd+bwd"),
    )
    if overrides:
        results["config_overrides"] = overrides
    if torch_note:
        results["torch_device"] = torch_note
    results["cells"].update(torch_cells)
    done = {k for k, e in results["cells"].items() if e.get("status") == "ok"} if args.resume else set()
    cells = [c for c in cells if c.key not in done]

    rows: dict[tuple, list[Cell]] = {}
    for c in cells:
        rows.setdefault((c.config, c.seq, c.causal), []).append(c)
    checker = Checker()
    memory_limit = device_memory_limit()
    new_entries = list(torch_cells.values())
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety
        tqdm = None
    bar = None if (args.quiet or tqdm is None) else tqdm(total=len(cells), desc="attention", unit="cell")
    for (config, seq, causal), row in rows.items():
        if time.perf_counter() - start > args.budget_s:
            entries = [record(c, "skipped", error=f"budget of {args.budget_s:.0f} s spent") for c in row]
        else:
            if bar is not None:
                bar.set_postfix_str(f"{config} T={seq} causal={causal}")
            entries = run_row(row, args.compile_workers, checker, args.reps, memory_limit, overrides, rounds)
        for e in entries:
            key = cell_key(e["config"], e["seq"], e["causal"], e["mode"], e["impl"])
            if e["status"] != "skipped" or key not in results["cells"]:  # a skip never hides a measurement
                results["cells"][key] = e
        new_entries += entries
        save_results(path, results)  # after every row: an interrupted sweep keeps what it measured
        if bar is not None:
            bar.update(len(row))
    if bar is not None:
        bar.close()
    save_results(path, results)

    this_run = {cell_key(e["config"], e["seq"], e["causal"], e["mode"], e["impl"]): e for e in new_entries}
    print(f"\n{device} | jax {jax.__version__} | bf16, {256 if args.smoke else args.tokens} tokens per batch | {time.perf_counter() - start:.0f} s")
    print(table(this_run))
    issues = problems(new_entries)
    if issues:
        print("not measured:\n" + issues)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
