"""Ring attention over all visible GPUs against flash attention on one GPU.

    python benchmarks/ring.py                          # T = 32k, 64k, 128k; ~5-7 min on 2 H200s or 4 H100s
    python benchmarks/ring.py --seqlens 32768 --reps 3
    python benchmarks/ring.py --smoke                  # CPU: 2 host devices, tiny, interpret mode
    python benchmarks/ring.py --trace /tmp/traces      # also: where each ring cell's time goes

Problem: bfloat16, B = 1, H = 16, D = 128, self-attention of length T, causal (the
ring with zig-zag load balance) and not. Rows: "single" is `flash_attention` on
one GPU with the whole sequence; "ring" is `flashjax.ring.ring_attention` with the
sequence sharded over the N visible GPUs. Inputs, FLOPs (4*B*H*T*T*D forward,
halved when causal, x3.5 for forward+backward), the check and the timing are those of
`flashjax.benchmark` (its docstring has the protocol); TFLOP/s per GPU divides the
ring's by N, and the scaling efficiency is the ring's per-GPU TFLOP/s over the single
GPU's. Each cell is compiled once, checked against the float32 reference on the last
query rows (output, or dq for forward+backward; a mismatch is not timed), warmed up
(twice, the protocol's warm-up), then timed as the median of `--reps` repetitions. Cells past the time budget
(`--budget`, default 360 s) are recorded as skipped, so the run stays under 8 minutes
(the last cell started, 128k forward+backward on one GPU, takes well under a minute).

Writes benchmarks/results/ring-<device>-x<N>.json and prints a table. With ``--trace DIR``
each ring cell is also traced (3 back-to-back calls, `jax.profiler`, after its timing) and
its entry gets ``trace``: per call, mean over the GPUs, the time kernels run, the time the
K/V transfers (NCCL) run and how much of that is under a kernel (benchmarks/device_trace.py).

NCCL_NVLS_ENABLE=0 is set before JAX starts: NCCL's NVLink SHARP (multicast)
collectives can put the shared GPUs of a host out of service for a long time on
the machines we benchmark on; point-to-point ppermute gains nothing from them.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before jax (and NCCL) load: see the docstring

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flashjax import benchmark  # noqa: E402  (the protocol: flashjax/benchmark.py)
import device_trace  # noqa: E402  (benchmarks/device_trace.py)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SEQLENS = (32768, 65536, 131072)
HEADS, HEAD_DIM = 16, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="comma-separated T")
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
    p.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    p.add_argument("--reps", type=int, default=10, help="timed calls per cell (median)")
    p.add_argument("--budget", type=float, default=360.0, help="seconds; later cells are skipped")
    p.add_argument("--out", default=None, help="output .json (default benchmarks/results/ring-<device>-x<N>.json)")
    p.add_argument("--smoke", action="store_true", help="CPU check of the script: 2 host devices, tiny shapes")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="trace each ring cell after timing it (perfetto traces under DIR; a summary per entry)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import flashjax
    from flashjax.ring import ring_attention, zigzag_order, zigzag_restore

    heads, head_dim, dtype = (2, 32, jnp.float32) if args.smoke else (HEADS, HEAD_DIM, jnp.bfloat16)
    seqlens = [256] if args.smoke else benchmark.parse_list(args.seqlens, None, "seqlen", benchmark.parse_seq)
    modes = benchmark.parse_list(args.modes, benchmark.MODES, "mode")
    causals = benchmark.causal_values(args.causal)
    devices = jax.devices()
    n = len(devices)
    device = devices[0].device_kind
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,))
    seq_sharding = NamedSharding(mesh, P(None, "sp", None, None))
    one_gpu = jax.sharding.SingleDeviceSharding(devices[0])
    backend = "triton" if args.smoke else "auto"
    start = time.perf_counter()
    entries = []
    checker = benchmark.Checker()

    def attend(impl, causal):
        if impl == "single":
            return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, backend=backend)
        # Causal inputs arrive in zig-zag order (see below); the check restores the output.
        return lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=causal, backend=backend)

    for seq in seqlens:
        problem = benchmark.Cell("ring", heads, heads, head_dim, seq, False, "fwd", "single", tokens=seq)  # B = 1
        host = benchmark.make_inputs(problem, seed=seq, dtype=dtype)  # q, k, v, do of every cell of this T
        for causal in causals:
            for mode in modes:
                for impl in ("single", "ring"):
                    cell = dataclasses.replace(problem, causal=causal, mode=mode, impl=impl)
                    entry = dict(impl=impl, seq=seq, causal=causal, mode=mode, devices=1 if impl == "single" else n,
                                 heads=heads, head_dim=head_dim, dtype=jnp.dtype(dtype).name)
                    entries.append(entry)
                    if time.perf_counter() - start > args.budget:
                        entry["status"] = "skipped (time budget)"
                        continue
                    trace_line = None
                    try:
                        sharding = one_gpu if impl == "single" else seq_sharding
                        inputs = host
                        if impl == "ring" and causal:  # the layout load balancing expects
                            inputs = [zigzag_order(x, n) for x in host]
                        args_ = tuple(jax.device_put(x, sharding) for x in inputs)
                        # The kernels `auto` picks for the (per-device block of the) call.
                        block = jax.ShapeDtypeStruct((1, seq // entry["devices"], heads, head_dim), dtype)
                        entry["backend"] = flashjax.explain(block, block, block, causal=causal, backend=backend).backend
                        compiled, entry["temp_bytes"] = benchmark.compile_cell(cell, attend(impl, causal), args_)
                        result = compiled(*args_)
                        got = result
                        if impl == "ring" and causal:  # the output, or dq, dk and dv
                            got = jax.tree.map(lambda x: zigzag_restore(x, n), got)
                        entry["rel_err"] = checker.check(cell, got, *host)
                        del result, got
                        if not all(e < benchmark.TOLERANCE for e in entry["rel_err"].values()):  # nan fails too
                            entry.update(status="mismatch", error=f"rel err {entry['rel_err']} >= {benchmark.TOLERANCE}")
                        else:
                            seconds, times, _ = benchmark.median_time(lambda: compiled(*args_), jax.block_until_ready,
                                                                      reps=args.reps)
                            per_gpu = cell.flops() / entry["devices"] / seconds / 1e12
                            entry.update(status="ok", seconds=seconds, times=times, tflops_per_gpu=per_gpu)
                            if args.trace and impl == "ring":
                                where = f"{args.trace}/{seq}-{int(causal)}-{mode}"
                                trace_line = _trace(entry, lambda: compiled(*args_), where)
                    except Exception as e:  # recorded, never a crash: the other cells still run
                        entry.update(status="oom" if benchmark.is_oom(e) else "error", error=benchmark.short_error(e))
                    print(_row(entry), flush=True)
                    if trace_line:
                        print("  " + trace_line, flush=True)
                _efficiency(entries[-2:])

    report = dict(
        device=device, devices=n, jax=jax.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
        nccl_nvls_enable=os.environ["NCCL_NVLS_ENABLE"], wall_seconds=time.perf_counter() - start, entries=entries,
    )
    out = benchmark.results_path(RESULTS_DIR, args.out, f"{device} x{n}", prefix="ring-", smoke=args.smoke)
    benchmark.save_results(out, report)
    print()
    print(_table(entries, n))
    print(f"\nwrote {out} ({report['wall_seconds']:.0f} s)")


def _trace(entry, call, directory: str, calls: int = 3) -> str:
    """Traces `calls` back-to-back calls into `directory`; the entry gets the per-call means
    over the GPUs (``trace``) or, if tracing fails, the error (``trace_error``): the timing
    stands either way. Returns the line to print."""
    import jax

    try:
        traced = device_trace.summarize(device_trace.capture(call, jax.block_until_ready, calls, directory), calls)
    except Exception as e:
        entry["trace_error"] = benchmark.short_error(e)
        return f"trace failed: {entry['trace_error']}"
    entry["trace"] = device_trace.mean_over_devices(traced)
    return device_trace.describe(traced)


def _efficiency(pair):
    single, ring = pair
    if single.get("status") == "ok" and ring.get("status") == "ok":
        ring["efficiency"] = ring["tflops_per_gpu"] / single["tflops_per_gpu"]
        ring["speedup"] = single["seconds"] / ring["seconds"]


def _row(e) -> str:
    what = f"T={e['seq']:>6} {'causal' if e['causal'] else 'full  '} {e['mode']:<6} {e['impl']:<6} x{e['devices']}"
    if e.get("status") != "ok":
        return f"{what}  {e.get('status')} {e.get('error', '')}"
    return (f"{what}  {e['seconds'] * 1e3:9.1f} ms  {e['tflops_per_gpu']:6.1f} TF/s/GPU  err {max(e['rel_err'].values()):.1e}"
            f"  ({e['backend']})")


def _table(entries, n) -> str:
    lines = [f"| T | causal | mode | 1 GPU ms | 1 GPU TF/s | ring x{n} ms | ring TF/s/GPU | speed-up | efficiency |",
             "|---|---|---|---|---|---|---|---|---|"]
    for single, ring in zip(entries[0::2], entries[1::2]):
        cell = lambda e, k, f, unit=1: f.format(e[k] * unit) if k in e else e.get("status", "-")
        lines.append(
            f"| {single['seq']} | {'yes' if single['causal'] else 'no'} | {single['mode']} | "
            f"{cell(single, 'seconds', '{:.2f}', 1e3)} | {cell(single, 'tflops_per_gpu', '{:.0f}')} | "
            f"{cell(ring, 'seconds', '{:.2f}', 1e3)} | {cell(ring, 'tflops_per_gpu', '{:.0f}')} | "
            f"{cell(ring, 'speedup', '{:.2f}x')} | {cell(ring, 'efficiency', '{:.0%}')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
