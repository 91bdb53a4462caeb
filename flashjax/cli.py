"""The ``flashjax`` command: ``flashjax demo`` and ``flashjax bench``.

    flashjax demo            # check against the reference, say which backend runs; on a GPU, time vs XLA and cuDNN
    flashjax demo --quick    # the smallest check (seconds, any device)
    flashjax bench [flags]   # benchmarks/attention.py of the repository (flashjax bench --help)

The demo needs nothing but the package and measures with `flashjax.benchmark`;
``bench`` runs the benchmark scripts of a source checkout (they are not part of the
installed package).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

__all__ = ["main", "demo", "bench"]

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def build_parser() -> argparse.ArgumentParser:
    """``flashjax [-h] [--version] {demo,bench} ...``: plain-text help for each command."""
    from flashjax import __version__

    parser = argparse.ArgumentParser(
        prog="flashjax",
        description="Exact, IO-aware (Flash) attention for JAX: check it on this device, or benchmark it.",
        epilog="Run 'flashjax COMMAND --help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"flashjax {__version__}")
    commands = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    demo_parser = commands.add_parser(
        "demo",
        help="check flashjax against the float32 reference here and say which backend runs; time it on a GPU",
        description="Checks flashjax (backend='auto') against the float32 reference, says which backend runs "
        "each problem and why faster ones do not, then, on a GPU, times it beside XLA and cuDNN. "
        "Exits 1 if a check fails.",
    )
    demo_parser.add_argument("--quick", action="store_true", help="one tiny check (and one tiny timing on a GPU)")
    timing = demo_parser.add_mutually_exclusive_group()
    timing.add_argument("--no-timing", action="store_true", help="checks only")
    timing.add_argument("--timing", action="store_true",
                        help="time even without a GPU (interpret-mode times on a CPU say nothing about the kernels)")
    # Listed for the help; its flags are benchmarks/attention.py's (flashjax bench --help).
    commands.add_parser("bench", add_help=False,
                        help="the attention benchmark of a source checkout (benchmarks/attention.py)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flashjax`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every later flag is the benchmark's
        return bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, or a usage error (2)
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_help()
        return 0
    return _demo(args)


# ---- bench ------------------------------------------------------------------------------
def bench(argv: list[str]) -> int:
    """Runs ``benchmarks/attention.py``'s ``main(argv)`` from the source checkout."""
    script = BENCHMARKS_DIR / "attention.py"
    if not script.exists():
        print(
            f"flashjax bench runs the benchmark scripts of a source checkout, and {script} does not exist.\n"
            "Clone the repository and install it editable (bash scripts/setup.sh), or run\n"
            "'python benchmarks/attention.py' from the checkout.",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("flashjax_benchmarks_attention", script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS_DIR))  # the benchmark imports its sibling scripts
    sys.modules[spec.name] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    try:
        return int(module.main(argv, prog="flashjax bench") or 0)
    except SystemExit as exit_:  # --help (0), a usage error (2), or a refusal with a message (1, as Python exits)
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)
        return 1


# ---- demo -------------------------------------------------------------------------------
def demo(argv: list[str]) -> int:
    """``flashjax demo [flags]``: checks flashjax against the reference, then times it; 1 if a check fails."""
    return main(["demo", *argv])


class _NoBar:
    def update(self, n: int = 1):
        pass

    def close(self):
        pass


def _bar(total: int, desc: str):
    """A tqdm progress bar when tqdm is installed (it is optional), else none."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, leave=False)


def _cell(shape, causal: bool, mode: str = "fwdbwd", impl: str = "flashjax"):
    """The `flashjax.benchmark.Cell` of a demo problem (batch, seq, heads, kv_heads, head_dim)."""
    from flashjax import benchmark

    b, t, h, hkv, d = shape
    return benchmark.Cell("demo", h, hkv, d, t, causal, mode, impl, tokens=b * t)


def _output_and_grads(fn, q, k, v, do):
    """fn(q, k, v) and its (dq, dk, dv) for the cotangent do, as one compiled program: an
    eager jax.vjp would compile the forward, the backward and (for the reference) every op
    apart, which on a GPU costs about a minute per problem."""
    import jax

    def run(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do.astype(out.dtype))

    return jax.jit(run)(q, k, v, do)


def check(shape, causal: bool, dtype, tol: float) -> tuple[bool, str]:
    """flashjax (backend="auto") output and (dq, dk, dv) against the float32 reference.

    Returns (passed, two lines: the errors, and the backends that run it and why faster ones do not).
    """
    import jax.numpy as jnp

    import flashjax
    from flashjax import benchmark, reference

    q, k, v, do = benchmark.make_inputs(_cell(shape, causal), dtype=dtype)
    out, grads = _output_and_grads(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal), q, k, v, do)
    f32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_grads = _output_and_grads(lambda q, k, v: reference.attention(q, k, v, causal=causal),
                                           f32(q), f32(k), f32(v), f32(do))
    errs = [benchmark.rel_err(out, ref_out)] + [benchmark.rel_err(a, b) for a, b in zip(grads, ref_grads)]
    ok = all(e < tol for e in errs)  # nan fails
    b, t, h, hkv, d = shape
    label = f"B={b} T={t} H={h}/{hkv} D={d} {jnp.dtype(dtype).name} causal={causal}"
    detail = "rel err out/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
    choice = flashjax.explain(q, k, v, causal=causal)
    return ok, f"{'ok  ' if ok else 'FAIL'} {label:44s} {detail} (tol {tol:g})\n     {explain_line(choice)}"


def explain_line(choice) -> str:
    """One line of a `flashjax.backends.Choice`: the backends that run, and why faster ones do not."""
    if choice.backend == choice.backward_backend:
        line = f"backend: {choice.backend}"
    else:
        line = f"backend: {choice.backend} forward, {choice.backward_backend} backward"
    passed = [f"not {name}: {'; '.join(reasons)}" for name, reasons in choice.passed]
    passed += [f"backward not {name}: {'; '.join(reasons)}" for name, reasons in choice.backward_passed]
    return line + (f" ({'; '.join(passed)})" if passed else "")


def _demo_plan(platform: str, quick: bool):
    """(checks, dtype, tolerance, timings, impls, reps) suited to the device: tiny on the CPU, realistic on a GPU."""
    import jax.numpy as jnp

    if platform == "gpu" and not quick:
        checks = [((2, 1024, 8, 8, 128), True), ((2, 2048, 16, 4, 64), False), ((1, 1000, 8, 8, 256), True)]
        timings = [((16384 // t, t, 16, 16, 128), c) for t in (1024, 4096, 16384) for c in (False, True)]
        return checks, jnp.bfloat16, 2e-2, timings, ("flashjax", "cudnn", "xla"), 10
    if platform == "gpu":
        return [((1, 512, 4, 4, 64), True)], jnp.bfloat16, 2e-2, [((4, 1024, 8, 8, 64), True)], ("flashjax", "cudnn", "xla"), 10
    if quick:
        return [((1, 128, 2, 1, 32), True)], jnp.float32, 1e-3, [((1, 128, 2, 2, 32), True)], ("flashjax", "xla"), 10
    # Each shape costs a ~10 s interpreter compile: two cover GQA, causal and ragged lengths.
    checks = [((1, 256, 4, 2, 64), True), ((2, 200, 4, 1, 32), False)]
    timings = [((1, 256, 4, 4, 64), True), ((1, 512, 4, 4, 64), True)]
    return checks, jnp.float32, 1e-3, timings, ("flashjax", "xla"), 10


def _impl(name: str, causal: bool):
    import jax

    import flashjax

    if name == "flashjax":
        return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=name)


def time_case(shape, causal: bool, dtype, impl: str, mode: str, reps: int, checker=None) -> float | str:
    """Median seconds of one implementation on one problem (checked against the reference
    first, as the benchmark does), or a short reason it was not timed."""
    import jax

    from flashjax import benchmark

    cell = _cell(shape, causal, mode, impl)
    if impl == "xla" and cell.batch * cell.heads * cell.seq * cell.seq * (6 if mode == "fwd" else 12) > 40e9:
        return "oom"  # XLA materialises the scores: skip what cannot fit rather than crash
    args = benchmark.make_inputs(cell, dtype=dtype)
    try:
        compiled, _ = benchmark.compile_cell(cell, _impl(impl, causal), args)
        errors = (checker or benchmark.Checker()).check(cell, compiled(*args), *args)
        if not all(e < benchmark.TOLERANCE for e in errors.values()):
            return "MISMATCH"
        return benchmark.median_time(lambda: compiled(*args), jax.block_until_ready, reps=reps)[0]
    except Exception as e:  # a peer missing on this device is reported, not fatal
        return "oom" if benchmark.is_oom(e) else "n/a"


def _demo(args) -> int:
    import warnings

    warnings.filterwarnings("ignore")  # the CPU interpreter's warnings would bury the table
    import jax

    import flashjax
    from flashjax import benchmark

    platform = jax.default_backend()
    checks, dtype, tol, timings, impls, reps = _demo_plan(platform, args.quick)
    device = jax.devices()[0].device_kind
    mode_note = "Pallas kernels compiled" if platform == "gpu" else "no GPU: Pallas kernels in interpret mode"
    print(f"flashjax {flashjax.__version__} | jax {jax.__version__} | {device} ({platform}; {mode_note})")

    lines, ok = [], True
    bar = _bar(len(checks), "checks")
    for shape, causal in checks:
        passed, line = check(shape, causal, dtype, tol)
        ok &= passed
        lines.append(line)
        bar.update()
    bar.close()
    print("\n".join(lines))
    if not ok:
        print("A check FAILED: flashjax disagrees with the reference (see above).", file=sys.stderr)
    if args.no_timing:
        return 0 if ok else 1
    if platform != "gpu" and not args.timing:
        print("timings: skipped; they need a GPU (interpret-mode times on a CPU are noise; --timing forces them)")
        return 0 if ok else 1

    rows, checker = [], benchmark.Checker()
    cases = [(s, c, m) for s, c in timings for m in ("fwd", "fwdbwd")]
    bar = _bar(len(cases) * len(impls), "timing")
    for shape, causal, mode in cases:
        row = {}
        for impl in impls:
            row[impl] = time_case(shape, causal, dtype, impl, mode, reps, checker)
            bar.update()
        rows.append((shape, causal, mode, row))
    bar.close()
    print(_timing_table(rows, impls, dtype))
    if platform != "gpu":
        print("(no GPU: these are interpret-mode times on a CPU, not the kernels' speed)")
    return 0 if ok else 1


def _timing_table(rows, impls, dtype) -> str:
    import jax.numpy as jnp

    from flashjax import benchmark

    header = ["B", "T", "H", "D", "causal", "mode"] + [f"{i} ms (TF/s)" for i in impls] + ["flashjax speedup"]
    lines = [header]
    for (b, t, h, _, d), causal, mode, row in rows:
        fl = benchmark.flops(b, h, t, t, d, causal, mode)
        cells = [str(b), str(t), str(h), str(d), "yes" if causal else "no", mode]
        for impl in impls:
            s = row[impl]
            cells.append(s if isinstance(s, str) else f"{s * 1e3:.3g} ({fl / s / 1e12:.3g})")
        mine = row["flashjax"]
        peers = [i for i in impls if i != "flashjax" and not isinstance(row[i], str)]
        cells.append("-" if isinstance(mine, str) or not peers else " ".join(f"x{row[i] / mine:.2f} vs {i}" for i in peers))
        lines.append(cells)
    widths = [max(len(l[c]) for l in lines) for c in range(len(header))]
    out = ["  ".join(s.rjust(w) for s, w in zip(l, widths)) for l in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append(f"{jnp.dtype(dtype).name}; each result checked against the reference, then the median of the "
               "protocol of flashjax.benchmark; speedup = peer time / flashjax time")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
