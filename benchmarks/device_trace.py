"""Where a multi-GPU call's time goes: kernels, collectives, and how much of the collectives
ran under a kernel, read from a JAX profiler trace.

    python benchmarks/device_trace.py TRACE.json.gz [--calls N]   # a trace written by capture()

`capture` records back-to-back calls of a function with `jax.profiler.trace(...,
create_perfetto_trace=True)`; `summarize` reads the perfetto JSON it writes. Each GPU is
one process of the trace ("/device:GPU:<i>"), each of its CUDA streams a thread, each kernel
or copy an event with a start and a duration (microseconds). Per device:

* ``span``: first event's start to last event's end;
* ``kernels``: time at least one non-collective kernel runs (copies and memsets left out);
* ``collectives``: time at least one NCCL kernel runs (a ``ppermute`` is one);
* ``hidden``: the part of ``collectives`` during which a non-collective kernel also runs,
  on another stream: communication overlapped by compute. ``collectives - hidden`` is
  communication on the critical path.

Used by `benchmarks/ring.py --trace` (benchmarks/results/ring-notes.md has what it showed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

DEVICE_PROCESS = re.compile(r"/device:GPU:(\d+)")
COPY_EVENT = re.compile(r"^(Memcpy|Memset)")


def capture(call, sync, calls: int = 3, directory: str | None = None) -> Path:
    """Traces `calls` back-to-back calls (then `sync`) and returns the perfetto JSON's path."""
    import jax

    directory = directory or tempfile.mkdtemp(prefix="flashjax-trace-")
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        out = None
        for _ in range(calls):
            out = call()
        sync(out)
    found = sorted(Path(directory).glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {directory}")
    return found[-1]


def covered(intervals):
    """The union of [start, end) intervals as sorted disjoint intervals."""
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def union_length(intervals) -> float:
    """Total length covered by [start, end) intervals."""
    return sum(b - a for a, b in covered(intervals))


def intersection_length(first, second) -> float:
    """Length of the intersection of two interval unions."""
    a, b = covered(first), covered(second)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(path, calls: int = 1) -> dict[int, dict[str, float]]:
    """{GPU index: {span, kernels, collectives, hidden} in ms per call} from a perfetto trace
    (empty without GPU events: a CPU run)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpus = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            match = DEVICE_PROCESS.search(str(e.get("args", {}).get("name", "")))
            if match:
                gpus[e["pid"]] = int(match.group(1))
    spans: dict[int, list] = {g: [] for g in gpus.values()}
    kernels: dict[int, list] = {g: [] for g in gpus.values()}
    collectives: dict[int, list] = {g: [] for g in gpus.values()}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        gpu, interval = gpus[e["pid"]], (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        spans[gpu].append(interval)
        name = str(e.get("name", ""))
        if "nccl" in name.lower():
            collectives[gpu].append(interval)
        elif not COPY_EVENT.match(name):
            kernels[gpu].append(interval)
    per_call = lambda us: us / 1e3 / max(calls, 1)
    summary = {}
    for gpu in sorted(spans):
        if not spans[gpu]:
            continue
        start, end = min(a for a, _ in spans[gpu]), max(b for _, b in spans[gpu])
        summary[gpu] = dict(span=per_call(end - start), kernels=per_call(union_length(kernels[gpu])),
                            collectives=per_call(union_length(collectives[gpu])),
                            hidden=per_call(intersection_length(collectives[gpu], kernels[gpu])))
    return summary


def mean_over_devices(summary: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each field's mean over the devices (empty for an empty summary)."""
    if not summary:
        return {}
    fields = next(iter(summary.values())).keys()
    return {k: sum(s[k] for s in summary.values()) / len(summary) for k in fields}


def describe(summary: dict[int, dict[str, float]]) -> str:
    """One line: the per-call means over the devices."""
    mean = mean_over_devices(summary)
    if not mean:
        return "trace: no GPU events"
    exposed = mean["collectives"] - mean["hidden"]
    return (f"trace, per call, mean of {len(summary)} GPUs: span {mean['span']:.2f} ms, kernels {mean['kernels']:.2f} ms, "
            f"collectives {mean['collectives']:.2f} ms ({mean['hidden']:.2f} under a kernel, {exposed:.2f} exposed)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="perfetto_trace.json.gz written by jax.profiler")
    p.add_argument("--calls", type=int, default=1, help="calls the trace holds (figures are per call)")
    args = p.parse_args(argv)
    summary = summarize(args.trace, args.calls)
    for gpu, s in summary.items():
        print(f"GPU {gpu}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in s.items()))
    print(describe(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
