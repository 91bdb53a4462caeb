"""Tuned tilings: the per-backend tables the configs read, and the search that writes them.

Each kernel backend keeps a JSON table beside its code (``kernels/<backend>/tuned.json``)::

    {"default": {"128": {field: value, ...}, ...},          # built in, used on any GPU
     "nvidia-h100-80gb-hbm3": {"128": {field: value, "_source": "..."}}}  # measured per GPU model

`entry` merges the measured fields of this GPU over the defaults; nothing is timed at
import or call time. `search` is what ``benchmarks/tune.py`` runs to fill a GPU's entry:
it checks every candidate against the float32 reference before timing it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
from pathlib import Path

__all__ = ["device_slug", "entries", "entry", "write_entry", "search"]


def device_slug(name: str) -> str:
    """A file-name-safe device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def first_gpu_kind() -> str | None:
    """The device kind of the first JAX device when it is a GPU (else None)."""
    import jax

    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else None


@functools.cache
def _table(path: Path) -> dict:
    if not path.exists():
        return {}
    with open(path) as f:
        return json.load(f)


def entries(path: Path) -> frozenset[str]:
    """The keys (head dims, or "DxDv" pairs) of a table's built-in defaults."""
    return frozenset(_table(Path(path)).get("default", {}))


def entry(path: Path, head_dim: int | str, device_kind: str | None) -> dict:
    """The fields for a head dim (or a "DxDv" key): this GPU's measured entry over the built-in
    default.

    Keys starting with "_" (notes such as "_source") are dropped. Raises KeyError when
    the table has no default for the head dim.
    """
    table = _table(Path(path))
    fields = dict(table["default"][str(head_dim)])
    measured = table.get(device_slug(device_kind or ""), {}).get(str(head_dim), {})
    fields.update(measured)
    return {k: v for k, v in fields.items() if not k.startswith("_")}


def write_entry(path: Path, device_kind: str, head_dim: int, fields: dict, note: str) -> dict:
    """Writes a GPU's measured fields for one head dim into a table (other entries kept)."""
    path = Path(path)
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(device_slug(device_kind), {})[str(head_dim)] = dict(fields, _source=note)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    _table.cache_clear()
    return table


# ---- the search ---------------------------------------------------------------------------
def search(cells, candidates, make_call, *, reps: int = 10, deadline: float = math.inf, compile_workers: int = 4):
    """Checks and times every candidate on every cell; returns one dict per candidate.

    Args:
      cells: `flashjax.benchmark.Cell`s (problem and mode) to score on.
      candidates: backend configs to try (the current default first).
      make_call: ``make_call(cell, candidate) -> fn(q, k, v)``.
      reps: timed repetitions per (candidate, cell).
      deadline: `time.perf_counter()` value after which nothing more is timed.

    Returns:
      ``[{"config": asdict(candidate), "runs": [...], "score": geometric-mean TFLOP/s or None}]``;
      a candidate that fails to compile, disagrees with the reference or runs out of
      time has no score.
    """
    import concurrent.futures

    import jax

    from flashjax import benchmark

    results = [dict(config=dataclasses.asdict(c) if dataclasses.is_dataclass(c) else repr(c), runs=[]) for c in candidates]
    checker = benchmark.Checker()
    for cell in cells:
        if time.perf_counter() > deadline:
            break
        inputs = benchmark.make_inputs(cell)

        def compile_one(candidate):
            try:
                fn = make_call(cell, candidate)
                return jax.jit(benchmark.timed_fn(cell, fn)).lower(*inputs).compile(), None
            except Exception as e:  # a tile that does not compile (shared memory, registers) is skipped
                return None, benchmark.short_error(e)

        with concurrent.futures.ThreadPoolExecutor(max(1, compile_workers)) as pool:
            compiled = list(pool.map(compile_one, candidates))
        for result, (executable, error) in zip(results, compiled):
            run = dict(seq=cell.seq, causal=cell.causal, mode=cell.mode)
            if executable is not None and time.perf_counter() < deadline:
                try:
                    # A tile that computes the wrong thing fast must not win.
                    errors = checker.check(cell, executable(*inputs), *inputs)
                    run["rel_err"] = errors
                    if not max(errors.values()) < benchmark.TOLERANCE:
                        error = f"mismatch: relative error {errors}"
                    else:
                        median, _, _ = benchmark.median_time(lambda: executable(*inputs), jax.block_until_ready, reps=reps)
                        run.update(ms=median * 1e3, tflops=cell.flops() / median / 1e12)
                except Exception as e:
                    error = benchmark.short_error(e)
            if "tflops" not in run:
                run["error"] = error or "budget spent"
            result["runs"].append(run)
    for result in results:
        tflops = [r["tflops"] for r in result["runs"] if "tflops" in r]
        complete = len(tflops) == len(cells) and tflops
        result["score"] = math.exp(sum(map(math.log, tflops)) / len(tflops)) if complete else None
    return results
