"""The benchmark harness: problems, FLOP counts, checks against the reference, timing and results files.

Every benchmark in ``benchmarks/``, the ``flashjax demo`` / ``flashjax bench`` commands
and the tile search (`flashjax.tuning`) measure with this module, so they all follow
one protocol:

* **Problems**: bfloat16, ``tokens`` tokens per batch (16384 by default, so B = 16384 // T),
  [batch, seq, heads, head_dim] inputs drawn from a standard normal.
* **FLOPs**: ``4 * B * H * Tq * Tk * D`` for the forward (two matrix products of
  ``2 * Tq * Tk * D``), halved when causal, and 3.5 times that for forward+backward
  (the backward counts 2.5 forwards: five products where the forward has two).
  Forward+backward is ``jax.grad`` of ``sum(out * cotangent)`` w.r.t. q, k, v.
* **Checks**: each compiled program's result is compared with the float32 reference
  (`flashjax.reference`) before it is timed: the output, or dq for forward+backward,
  on the last `CHECK_ROWS` query rows of batch row 0 (rows of bottom-right aligned
  causal attention depend only on their own query, so a slice of the real problem is
  an exact check), and for forward+backward dk and dv of batch row 0's first kv heads
  (over every query row, by chunks of rows). A relative (Frobenius) error of
  `TOLERANCE` or more in any of them marks the cell "mismatch" and it is not timed.
* **Timing**: two warm-up calls, then the median of >= 10 repetitions of a few
  back-to-back calls (more for short calls, to hide launch gaps) ended by
  ``block_until_ready``.
* **Results**: JSON records per cell with the device name, merged into a file per
  device under ``benchmarks/results/``.

The scripts' shared command-line pieces live here too: `parse_list`, `parse_seq`,
`causal_values` for their flags, and `config_overrides`, which applies
``"field=value,..."`` to a backend config (``--mosaic-config bwd_stages=3``,
``--triton-config fwd.block_k=64``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from flashjax.tuning import device_slug

__all__ = [
    "Cell", "flops", "median_time", "rel_err", "make_inputs", "timed_fn", "compile_cell", "Checker", "reference_kv_grads",
    "record", "load_results", "save_results", "TOKENS", "TOLERANCE", "CHECK_ROWS",
    "config_overrides", "parse_list", "parse_seq", "causal_values",
]

TOKENS = 16384
CHECK_ROWS = 256  # query rows of batch row 0 compared with the reference
TOLERANCE = 2e-2  # relative (Frobenius) error allowed for bf16 against the float32 reference
MODES = ("fwd", "fwdbwd")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One measurement: a problem (config, T, causal), a mode and an implementation."""

    config: str
    heads: int
    kv_heads: int
    head_dim: int
    seq: int
    causal: bool
    mode: str
    impl: str
    tokens: int = TOKENS

    @property
    def batch(self) -> int:
        return max(1, self.tokens // self.seq)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def key(self) -> str:
        return cell_key(self.config, self.seq, self.causal, self.mode, self.impl)

    def flops(self) -> float:
        return flops(self.batch, self.heads, self.seq, self.seq, self.head_dim, self.causal, self.mode)


def cell_key(config: str, seq: int, causal: bool, mode: str, impl: str) -> str:
    """The JSON key of a cell, e.g. ``d128/T4096/causal/fwdbwd/flashjax``."""
    return f"{config}/T{seq}/{'causal' if causal else 'full'}/{mode}/{impl}"


def flops(batch, heads, seq_q, seq_k, head_dim, causal, mode="fwd") -> float:
    """4*B*H*Tq*Tk*D forward, halved if causal; x3.5 for forward+backward.

    Causal attention is aligned bottom-right, so with Tq != Tk the pairs counted are
    Tq*Tk - Tq^2/2 (Tq <= Tk: every query sees the keys before the last Tq, and half of
    those) or Tk^2/2 (Tq > Tk: the first Tq - Tk queries see no key); Tq = Tk gives T^2/2."""
    pairs = float(seq_q) * seq_k
    if causal:
        pairs = pairs - seq_q * seq_q / 2.0 if seq_q <= seq_k else seq_k * seq_k / 2.0
    fwd = 4.0 * batch * heads * pairs * head_dim
    return fwd * (3.5 if mode == "fwdbwd" else 1.0)


# At most this many back-to-back calls per repetition with `span_s`.
MOST_INNER_CALLS = 50


def inner_calls(seconds_per_call: float, span_s: float | None = None) -> int:
    """Back-to-back calls per repetition: enough to hide the launch gap of short calls, or
    with `span_s` enough for a repetition to last span_s seconds (at least as many, at most
    MOST_INNER_CALLS): the steady state of a loop of short steps, where the host's round
    trip per repetition (dispatch of the first call, the final sync) would otherwise count."""
    few = 5 if seconds_per_call < 1e-3 else 3 if seconds_per_call < 1e-2 else 2 if seconds_per_call < 5e-2 else 1
    if span_s is None:
        return few
    return max(few, min(MOST_INNER_CALLS, math.ceil(span_s / max(seconds_per_call, 1e-9))))


def median_time(call, sync, *, reps: int = 10, warmup: int = 2, span_s: float | None = None):
    """Median seconds per call over `reps` repetitions of a few back-to-back calls + `sync`
    (`inner_calls`; with `span_s`, as many as fill that many seconds).

    `call()` launches the work and returns what `sync` waits on. Returns (median, times, inner).
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        sync(call())
    per_call = (time.perf_counter() - t0) / max(warmup, 1)
    inner = inner_calls(per_call, span_s)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = call()
        sync(out)
        times.append((time.perf_counter() - t0) / inner)
    return float(np.median(times)), times, inner


def rel_err(a, b) -> float:
    """Relative Frobenius error of `a` against `b`, in float64 (nan if either is not finite)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def problems(entries: list[dict]) -> str:
    """One line per cell that was neither measured nor declared unsupported/unavailable."""
    bad = [e for e in entries if e["status"] not in ("ok", "unsupported", "unavailable")]
    return "\n".join(f"  {cell_key(e['config'], e['seq'], e['causal'], e['mode'], e['impl'])}: "
                     f"{e['status']} {e.get('error', '')[:160]}" for e in bad)


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return text[:300]


def is_oom(e) -> bool:
    """Whether an exception (or a process's stderr text) says the device ran out of memory."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def make_inputs(cell: Cell, seed: int = 0, dtype=None):
    """(q, k, v, do) for the cell's problem (bf16 unless `dtype`); do is the random cotangent of fwd+bwd."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.bfloat16 if dtype is None else dtype
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    b, t, d = cell.batch, cell.seq, cell.head_dim
    q = jax.random.normal(ks[0], (b, t, cell.heads, d), dtype)
    k = jax.random.normal(ks[1], (b, t, cell.kv_heads, d), dtype)
    v = jax.random.normal(ks[2], (b, t, cell.kv_heads, d), dtype)
    do = jax.random.normal(ks[3], (b, t, cell.heads, d), dtype)
    return q, k, v, do


def timed_fn(cell: Cell, fn):
    """What is timed: ``fn(q, k, v)``, or grad of sum(out * do) w.r.t. (q, k, v); both take (q, k, v, do)."""
    import jax
    import jax.numpy as jnp

    if cell.mode == "fwd":
        return lambda q, k, v, do: fn(q, k, v)

    def loss(q, k, v, do):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))


def compile_cell(cell: Cell, fn, args, operands=None):
    """(compiled, temp_bytes): `timed_fn` compiled once, for the memory analysis and the timing.

    `operands`: None, or a pytree of arrays that `fn` takes as a fourth argument,
    ``fn(q, k, v, operands)`` (a bias, a mask): they become arguments of the compiled program
    rather than constants embedded in it (a 2 GiB constant takes minutes to compile). The
    returned callable takes `args` alone either way."""
    import functools

    import jax

    if operands is None:
        compiled = call = jax.jit(timed_fn(cell, fn)).lower(*args).compile()
    else:
        program = jax.jit(lambda ops, *a: timed_fn(cell, lambda q, k, v: fn(q, k, v, ops))(*a))
        compiled = program.lower(operands, *args).compile()
        call = functools.partial(compiled, operands)
    temp = None
    try:
        analysis = compiled.memory_analysis()
        temp = int(analysis.temp_size_in_bytes) if analysis is not None else None
    except Exception:  # some backends have no memory analysis: the cell still times
        pass
    return call, temp


def reference_kv_grads(qs, ks, vs, dos, rows_options, operands=(), chunk: int = 512):
    """(dk, dv) as NumPy arrays: the float32 reference's gradients of all query rows `qs`
    [1, Tq, H, D] (cotangents `dos`) over `ks`, `vs` [1, Tk, Hkv, D].

    dk and dv sum over every query row, so no slice of rows checks them; the reference runs
    over chunks of query rows (each chunk's vjp is its rows' share), never holding more than
    a chunk's scores, in one compiled program for every chunk. Inside it,
    ``rows_options(operands, start, size)`` gives the reference's options for rows
    [start, start + size) alone (what depends on a row's position, causal masks, ALiBi, a
    mod's query index, stated for these rows): `start` is a traced int32 scalar, and
    `operands` (a pytree of the problem's arrays: a bias, ids, tables) arguments of the
    program rather than constants in it."""
    import jax
    import jax.numpy as jnp

    from flashjax import reference

    seq_q = qs.shape[1]
    chunk = math.gcd(seq_q, chunk)

    def share(q_rows, do_rows, start, operands):
        options = rows_options(operands, start, q_rows.shape[1])
        attend = lambda k_, v_: reference.attention(q_rows, k_, v_, **options)
        return jax.vjp(attend, ks, vs)[1](do_rows)

    operands = jax.tree.map(jnp.asarray, operands)
    # The reference's matmuls need no autotuning to be exact (and XLA's autotuner is slow).
    compile_options = {"xla_gpu_autotune_level": 0} if jax.default_backend() == "gpu" else None
    compiled = jax.jit(share).lower(qs[:, :chunk], dos[:, :chunk], jnp.int32(0), operands).compile(compile_options)
    dk, dv = jnp.zeros_like(ks), jnp.zeros_like(vs)
    for start in range(0, seq_q, chunk):
        part = compiled(qs[:, start:start + chunk], dos[:, start:start + chunk], jnp.int32(start), operands)
        dk, dv = dk + part[0], dv + part[1]
    return np.asarray(dk), np.asarray(dv)


class Checker:
    """The float32 reference, per problem: the output or dq on the last CHECK_ROWS query rows
    of batch row 0, and dk, dv of batch row 0's first kv heads from every query row."""

    def __init__(self):
        self._cache = {}

    def _problem(self, cell: Cell, q, k, v, do):
        """(rows, heads, kv_heads, slices): the checked heads and the float32 slices of batch row 0."""
        import jax.numpy as jnp

        key = (cell.config, cell.seq, cell.causal, cell.mode, cell.tokens)
        if key not in self._cache:
            kv_heads = min(cell.kv_heads, 2)
            heads = kv_heads * (cell.heads // cell.kv_heads)
            f32 = lambda x: x.astype(jnp.float32)
            slices = f32(q[:1, :, :heads]), f32(k[:1, :, :kv_heads]), f32(v[:1, :, :kv_heads]), f32(do[:1, :, :heads])
            self._cache = {key: dict(rows=min(CHECK_ROWS, cell.seq), heads=heads, kv_heads=kv_heads, slices=slices)}
        return self._cache[key]

    def expected(self, cell: Cell, q, k, v, do):
        """(rows, heads, out, dq): the reference's output and dq (None in fwd) on the checked rows."""
        import jax

        from flashjax import reference

        problem = self._problem(cell, q, k, v, do)
        if "expected" not in problem:
            rows = problem["rows"]
            qs, ks, vs, dos = problem["slices"]

            # Causal attention is aligned bottom-right: the last `rows` queries against
            # all keys see exactly the keys they see in the full problem.
            def ref(q_):
                return reference.attention(q_, ks, vs, causal=cell.causal, scale=cell.scale)

            out, vjp = jax.vjp(ref, qs[:, -rows:])
            dq = vjp(dos[:, -rows:])[0] if cell.mode == "fwdbwd" else None
            problem["expected"] = dict(rows=rows, out=np.asarray(out), dq=None if dq is None else np.asarray(dq))
        e = problem["expected"]
        return e["rows"], problem["heads"], e["out"], e["dq"]

    def expected_kv_grads(self, cell: Cell, q, k, v, do):
        """(kv_heads, dk, dv): the reference's dk, dv [1, Tk, kv_heads, D] of batch row 0
        (`reference_kv_grads`)."""
        import jax.numpy as jnp

        from flashjax import reference

        problem = self._problem(cell, q, k, v, do)
        if "kv_grads" not in problem:
            qs, ks, vs, dos = problem["slices"]
            seq_q, seq_k = qs.shape[1], ks.shape[1]

            def rows_options(operands, start, size):
                if not cell.causal:
                    return {"scale": cell.scale}
                # The rows' own positions, bottom-right aligned as in the call.
                mask = reference.logits_mask(1, seq_q, seq_k, causal=True, rows=start + jnp.arange(size))
                return {"scale": cell.scale, "mask": mask}

            problem["kv_grads"] = reference_kv_grads(qs, ks, vs, dos, rows_options)
        return (problem["kv_heads"], *problem["kv_grads"])

    def check(self, cell: Cell, result, q, k, v, do) -> dict:
        """Relative errors {name: err}: of the output (fwd); of dq and, where `result` holds
        them, dk and dv (fwd+bwd; `result` is (dq,) or (dq, dk, dv), each full-size or the
        checked slice)."""
        rows, heads, out, dq = self.expected(cell, q, k, v, do)
        if cell.mode == "fwd":
            return {"out": rel_err(result[:1, -rows:, :heads], out)}
        errors = {"dq": rel_err(result[0][:1, -rows:, :heads], dq)}
        if len(result) == 3:
            kv_heads, dk, dv = self.expected_kv_grads(cell, q, k, v, do)
            errors.update(dk=rel_err(result[1][:1, :, :kv_heads], dk), dv=rel_err(result[2][:1, :, :kv_heads], dv))
        return errors


# ---- results files --------------------------------------------------------------------------
SMOKE_DIR = Path(tempfile.gettempdir()) / "flashjax-smoke"


def results_path(results_dir: Path, out: str | None, device: str, prefix: str = "", smoke: bool = False) -> Path:
    """``out`` (a .json file or a directory) or ``results_dir``, with ``<prefix><device slug>.json``.
    A smoke run without ``out`` writes to ``SMOKE_DIR`` (under the system's temporary
    directory): its tiny cells must not merge into the committed results, which the README's
    tables are built from."""
    name = f"{prefix}{device_slug(device)}.json"
    if out is None:
        return (SMOKE_DIR if smoke else Path(results_dir)) / name
    path = Path(out)
    return path if path.suffix == ".json" else path / name


def load_results(path: Path) -> dict:
    if Path(path).exists():
        with open(path) as f:
            return json.load(f)
    return {"cells": {}}


def save_results(path: Path, results: dict):
    """Writes atomically (a sweep interrupted mid-write keeps the previous file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def record(cell: Cell, status: str, **fields) -> dict:
    """The JSON record of one cell (with TFLOP/s when it has a median time)."""
    entry = dict(
        config=cell.config, heads=cell.heads, kv_heads=cell.kv_heads, head_dim=cell.head_dim,
        batch=cell.batch, seq=cell.seq, causal=cell.causal, mode=cell.mode, impl=cell.impl,
        status=status, flops=cell.flops(), time=datetime.datetime.now().isoformat(timespec="seconds"),
    )
    entry.update(fields)
    if entry.get("median_ms"):
        entry["tflops"] = cell.flops() / (entry["median_ms"] * 1e-3) / 1e12
    return entry


def device_name() -> str:
    import jax

    return jax.devices()[0].device_kind



# ---- command-line helpers of the benchmark scripts -----------------------------------------
def parse_list(text: str, allowed, kind: str, convert=str) -> list:
    """'a,b' -> [a, b], checked against `allowed` (None = anything)."""
    items = [convert(x.strip()) for x in text.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"unknown {kind} {bad}; choose from {list(allowed)}")
    return items


def parse_seq(text: str) -> int:
    """'4k' -> 4096, '16384' -> 16384."""
    text = text.lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def causal_values(text: str) -> list[bool]:
    """'both' -> [False, True]; 'yes'/'true' -> [True]; 'no'/'false' -> [False]."""
    values = {"both": [False, True], "yes": [True], "true": [True], "no": [False], "false": [False]}
    if text.lower() not in values:
        raise SystemExit(f"causal must be one of {sorted(values)}, got {text!r}")
    return values[text.lower()]


def config_overrides(config, text: str | None):
    """`config` (a dataclass, e.g. a MosaicConfig) with ``"field=value,..."`` applied.

    ``"kernel.field=value"`` reaches a nested dataclass (``"fwd.block_k=64"`` of a
    TritonConfig). Values that are whole numbers become ints, true / false bools and none
    None (any case), others stay strings; the config's own checks then run
    (``dataclasses.replace`` builds a new one). Empty or None `text` returns `config`
    unchanged.

    Raises:
      ValueError: an item without "=", or a field the config does not have.
    """
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config override {item!r} is not field=value")
        config = _replace_field(config, name.strip().split("."), _parse_value(value.strip()))
    return config


def _parse_value(text: str):
    """A whole number as an int, true/false as a bool, none as None; anything else as it is."""
    words = {"true": True, "false": False, "none": None}
    if text.lower() in words:
        return words[text.lower()]
    return int(text) if text.lstrip("-").isdigit() else text


def _replace_field(config, path: list[str], value):
    names = [f.name for f in dataclasses.fields(config)]
    if path[0] not in names:
        raise ValueError(f"{type(config).__name__} has no field {path[0]!r}; its fields: {', '.join(names)}")
    if len(path) > 1:
        value = _replace_field(getattr(config, path[0]), path[1:], value)
    return dataclasses.replace(config, **{path[0]: value})
