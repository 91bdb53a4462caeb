"""Benchmark of the attention variants: skipping must show in the times.

Rows, bf16, D = 128, H = 16, forward and forward+backward, flashjax's backends beside
cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) where cuDNN has the
variant:

* full row vs 4 packed documents per row (segment ids; cuDNN and tokamax get the
  equivalent block-diagonal boolean mask): the packed row should cost about a quarter,
  without and with a causal mask, and the causal one about as much as the 4 documents
  run as separate rows ("4 rows causal");
* 50% right padding (q/kv lengths; cuDNN: query/key_value_seq_lengths);
* sliding windows (1024 left, causal, T = 4k .. 64k; 4096 left, causal, T = 16k .. 64k):
  time linear in T (cuDNN: local_window_size; FlashAttention-3: window_size);
* an additive bias [1, H, T, T] (cuDNN: bias);
* a softcap of 30, and ALiBi, each with a causal mask at T = 8k and 16k, and dropout 0.1
  without a mask (no peer has these).

Implementations: `flashjax` is flash_attention(backend="triton"), `flashjax_mosaic`
is backend="mosaic" (the Hopper kernels); a backend that does not support a variant
(`flashjax.explain` says why) is recorded as unsupported, so variants appear in the
Mosaic column as that backend gains them. The peers, where they have the variant:
`cudnn`, `fa3` (flash-attn3-jax's flash_mha) and `tokamax` (tokamax.dot_product_attention
with its default implementation); a peer that is not installed is recorded as unavailable
("not run" in the tables), apart from one that lacks the variant (unsupported, "n/a").

Measured with `flashjax.benchmark` (its docstring has the protocol): each
implementation's output (forward) or dq (forward+backward) is first checked against
the float32 reference on CHECK_ROWS query rows of batch row 0 and two heads, with the
variant's options cut to those rows, and for forward+backward dk and dv of those heads
over every query row (`VariantChecker.expected_kv_grads`; dropout rows: dq alone); a
mismatch is not timed. Then each cell is timed as the
median of >= 10 repetitions. FLOPs are those of the dense problem (4 B H T^2 D, x3.5
for fwd+bwd), so a variant that skips work shows an "effective" rate above the dense
one; the `useful_fraction` column gives the fraction of (q, k) pairs that are visible.

    python benchmarks/variants.py [--out benchmarks/results/variants-<device>.json] [--quick]
    python benchmarks/variants.py --smoke --out /tmp/variants.json   # CPU: tiny, interpret mode
    python benchmarks/variants.py --only window,softcap --quick       # a subset of the rows
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashjax import benchmark  # noqa: E402  (the protocol: flashjax/benchmark.py)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEADS, HEAD_DIM = 16, 128
# impl -> flashjax backend; the peers follow.
BACKENDS = {"flashjax": "triton", "flashjax_mosaic": "mosaic"}
PEERS = ("cudnn", "fa3", "tokamax")
IMPLS = (*BACKENDS, *PEERS)
MODES = ("fwd", "fwdbwd")
CHECK_HEADS = 2


@dataclasses.dataclass(frozen=True, eq=False)  # compared (and hashed) by identity: options hold arrays
class Case:
    """One row: a variant of the problem, as flashjax options and as each peer's (None: the peer lacks it)."""

    name: str
    seq: int
    batch: int
    options: dict
    cudnn: dict | None
    visible: float  # fraction of (q, k) pairs that are visible
    check_end: int | None = None  # the checked query rows end here (None: the last rows)
    fa3: dict | None = None  # flash_mha keywords
    tokamax: dict | None = None  # tokamax.dot_product_attention keywords
    baseline: str = "full"  # the row of the same B x T that "vs full row" divides by
    heads: int = HEADS
    head_dim: int = HEAD_DIM


def cases(quick: bool, smoke: bool = False, only: str | None = None) -> list[Case]:
    """The rows; `smoke`: CPU-sized (H=2, D=32, T <= 512); `only`: comma-separated substrings,
    the rows whose name holds one, each optionally with "@T" for that sequence length alone
    (their arrays alone are made: the 16k bias is 8 GiB)."""

    def wanted(name: str, seq: int) -> bool:
        if only is None:
            return True
        for part in only.split(","):
            text, _, length = part.partition("@")
            if text in name and (not length or int(length) == seq):
                return True
        return False

    import jax
    import jax.numpy as jnp

    t, bias_t, window, long_window = (256, 128, 64, 128) if smoke else (16384, 4096, 1024, 4096)
    heads, head_dim = (2, 32) if smoke else (HEADS, HEAD_DIM)
    docs = 4

    def documents(seq, batch):
        """Segment ids of `docs` equal documents per row, and the block-diagonal mask they make."""
        seg = jnp.tile(jnp.repeat(jnp.arange(docs, dtype=jnp.int32), seq // docs)[None, :], (batch, 1))
        return seg, seg[:, None, :, None] == seg[:, None, None, :]

    causal = dict(causal=True)
    out = []
    # 16k tokens per batch at T/2 and T (smoke: the CPU-sized T only).
    for seq in (t,) if smoke else (t // 2, t):
        batch = t // seq
        seg, doc_mask = documents(seq, batch)
        half = jnp.full((batch,), seq // 2, jnp.int32)
        out += [
            Case("full", seq, batch, {}, {}, 1.0, fa3={}, tokamax={}),
            Case("full causal", seq, batch, causal, dict(is_causal=True), 0.5, fa3=dict(is_causal=True),
                 tokamax=dict(is_causal=True)),
            Case(f"segments x{docs}", seq, batch, dict(segment_ids=seg), dict(mask=doc_mask), 1.0 / docs,
                 tokamax=dict(mask=doc_mask)),
            Case(f"segments x{docs} causal", seq, batch, dict(segment_ids=seg, causal=True),
                 dict(mask=doc_mask, is_causal=True), 0.5 / docs, tokamax=dict(mask=doc_mask, is_causal=True),
                 baseline="full causal"),
            # The last rows are padding (output 0): the check takes the last valid ones.
            Case("padding 50%", seq, batch, dict(q_lengths=half, kv_lengths=half),
                 dict(query_seq_lengths=half, key_value_seq_lengths=half), 0.25, check_end=seq // 2),
            # The documents as a boolean mask [B, 1, T, T] for flashjax too (tile ranges from the mask).
            Case(f"mask (documents x{docs}) causal", seq, batch, dict(mask=doc_mask, causal=True),
                 dict(mask=doc_mask, is_causal=True), 0.5 / docs, tokamax=dict(mask=doc_mask, is_causal=True),
                 baseline="full causal"),
        ]
    # The packed row's documents as separate rows: the cost the packed causal row should approach.
    out.append(Case(f"{docs} rows causal", t // docs, docs, causal, dict(is_causal=True), 0.5,
                    fa3=dict(is_causal=True), tokamax=dict(is_causal=True), baseline="none"))
    out += [Case("full", bias_t, 4, {}, {}, 1.0, fa3={}, tokamax={})]
    # 16k tokens per batch (the bias alone is 8 GiB at T = 16k).
    for seq in (bias_t,) if smoke else (bias_t, 2 * bias_t, 4 * bias_t):
        if not wanted("bias [1,H,T,T]", seq):
            continue
        bias = jax.random.normal(jax.random.PRNGKey(3), (1, heads, seq, seq), jnp.bfloat16)
        out.append(Case("bias [1,H,T,T]", seq, 4 * bias_t // seq, dict(bias=bias), dict(bias=bias), 1.0,
                        tokamax=dict(bias=bias)))
    seqs = (256, 512) if smoke else (4096, 8192, 16384) if quick else (4096, 8192, 16384, 32768, 65536)
    for left, lengths in ((window, seqs), (long_window, seqs[-1:] if smoke else seqs[2:])):
        for seq in lengths:
            visible = causal_window_fraction(left, seq)
            out.append(Case(f"window {left} causal", seq, 1, dict(window=(left, 0), causal=True),
                            dict(local_window_size=(left, 0), is_causal=True), visible,
                            fa3=dict(is_causal=True, window_size=(left, 0)), baseline="full causal"))
    # Dropout (no peer has it): checked on the first rows, where the reference's keep mask
    # (positions from 0) is the kernels'.
    for seq in (t,) if smoke else (t // 2, t):
        out.append(Case("dropout 0.1", seq, t // seq, dict(dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(5)),
                        None, 1.0, check_end=min(seq, benchmark.CHECK_ROWS)))
    # Gemma 2's logit cap and ALiBi (cuDNN has neither); 16k tokens per batch.
    slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads), jnp.float32)
    for seq in (256, 512) if smoke else (8192, 16384):
        batch = 1 if smoke else max(1, 16384 // seq)
        out.append(Case("softcap 30 causal", seq, batch, dict(softcap=30.0, causal=True), None, 0.5,
                        baseline="full causal"))
        out.append(Case("alibi causal", seq, batch, dict(alibi_slopes=slopes, causal=True), None, 0.5,
                        baseline="full causal"))
    return [dataclasses.replace(c, heads=heads, head_dim=head_dim) for c in out if wanted(c.name, c.seq)]


def causal_window_fraction(left: int, seq: int) -> float:
    """The fraction of the [seq, seq] pairs a causal window of `left` keys scores: query i sees
    min(i, left) + 1 keys, (left + 1) * seq - left * (left + 1) / 2 pairs in all (left < seq)."""
    left = min(left, seq - 1)
    return ((left + 1) * seq - left * (left + 1) / 2) / seq**2


def cell(case: Case, mode: str, impl: str) -> benchmark.Cell:
    return benchmark.Cell(case.name, case.heads, case.heads, case.head_dim, case.seq, bool(case.options.get("causal")), mode, impl,
                          tokens=case.batch * case.seq)


def implementation(case: Case, impl: str, q, k, v):
    """(fn(q, k, v, arrays), arrays): the implementation with the case's options, its array
    options (bias, mask, ids, lengths) apart so that they are arguments of the compiled
    program; raises NotImplementedError (with the reasons) when it does not support the variant."""
    import jax

    import flashjax

    if impl in PEERS:
        options = getattr(case, impl)
        if options is None:
            raise NotImplementedError(f"{impl} has no such option")
        if impl == "cudnn":
            call = lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        else:
            try:
                peer = importlib.import_module("flash_attn3_jax" if impl == "fa3" else "tokamax")
            except ImportError as e:
                raise ImportError(f"{impl} is not installed ({e})") from None
            call = peer.flash_mha if impl == "fa3" else peer.dot_product_attention
    else:
        options = case.options
        backend = BACKENDS[impl]
        flashjax.explain(q, k, v, backend=backend, **options)  # NotImplementedError: the backend's reasons
        call = lambda q, k, v, **kw: flashjax.flash_attention(q, k, v, backend=backend, **kw)
    arrays, static = _split_arrays(options)
    return (lambda q, k, v, arrays: call(q, k, v, **static, **arrays)), arrays


def _split_arrays(options: dict) -> tuple[dict, dict]:
    """(array options: bias, mask, ids, lengths, keys; the others), so that the arrays can be
    arguments of a compiled program rather than constants in it."""
    import jax

    arrays = {name: value for name, value in options.items() if isinstance(value, jax.Array)}
    return arrays, {name: value for name, value in options.items() if name not in arrays}


# ---- the check: the reference on a slice of query rows ---------------------------------------
def _rows(case: Case) -> tuple[int, int]:
    end = case.seq if case.check_end is None else case.check_end
    if end != case.seq and (case.options.get("causal") or "window" in case.options):
        raise ValueError(f"{case.name}: causal or windowed rows are checked at the end (bottom-right alignment)")
    return max(0, end - benchmark.CHECK_ROWS), end


def _slice_option(name: str, value, start, size: int):
    """The option as the reference sees it for query rows [start, start + size) of batch row 0,
    heads [:CHECK_HEADS]; `start` an int or a traced int32 scalar."""
    import jax.numpy as jnp
    from jax import lax

    if name in ("causal", "window", "softcap", "dropout_rate", "dropout_rng"):
        return value
    if name == "alibi_slopes":
        return value[:CHECK_HEADS]
    if name == "segment_ids":
        return lax.dynamic_slice_in_dim(value[:1], start, size, axis=1), value[:1]
    if name == "q_lengths":
        return jnp.clip(value[:1] - start, 0, size)
    if name == "kv_lengths":
        return value[:1]
    if name in ("bias", "mask"):
        value = value[:1] if value.shape[1] == 1 else value[:1, :CHECK_HEADS]
        return value if value.shape[2] == 1 else lax.dynamic_slice_in_dim(value, start, size, axis=2)
    raise ValueError(f"no row slice for option {name!r}: add one to check this variant")


def _chunk_options(case: Case, operands: dict, start, size: int) -> dict:
    """The options as the reference sees them for query rows [start, start + size) of batch row
    0 among all keys (`start` traced, `operands` the case's array options, traced): sliced
    (`_slice_option`), with causal, the window and ALiBi, which the reference aligns to the
    rows it is given, stated for these rows' own positions (a mask, a bias)."""
    import jax.numpy as jnp

    from flashjax import reference

    positional = ("causal", "window", "alibi_slopes")
    options = {name: _slice_option(name, operands.get(name, value), start, size) for name, value in case.options.items()
               if name not in positional}
    rows = start + jnp.arange(size)[:, None]  # self-attention: aligned positions are the rows'
    cols = jnp.arange(case.seq)[None, :]
    allowed = reference.logits_mask(1, case.seq, case.seq, causal=bool(case.options.get("causal")),
                                    window=case.options.get("window"), rows=rows[:, 0])
    options["mask"] = allowed & options["mask"] if "mask" in options else allowed
    if "alibi_slopes" in case.options:
        slopes = jnp.asarray(operands.get("alibi_slopes", case.options["alibi_slopes"])[:CHECK_HEADS], jnp.float32)
        alibi = -slopes[None, :, None, None] * jnp.abs(rows - cols).astype(jnp.float32)[None, None]
        options["bias"] = alibi + options["bias"] if "bias" in options else alibi
    return options


class VariantChecker:
    """benchmark.Checker's check for a variant: the float32 reference on a slice of query rows
    (the output, dq), and over every query row by chunks (dk, dv of batch row 0)."""

    chunk = 512  # query rows per step of the dk / dv reference

    def __init__(self):
        self._cache = {}

    def expected(self, case: Case, mode: str, q, k, v, do):
        import jax
        import jax.numpy as jnp

        from flashjax import reference

        key = (case, mode)
        if key not in self._cache:
            start, end = _rows(case)
            f32 = lambda x: x.astype(jnp.float32)
            qs, dos = f32(q[:1, start:end, :CHECK_HEADS]), f32(do[:1, start:end, :CHECK_HEADS])
            ks, vs = f32(k[:1, :, :CHECK_HEADS]), f32(v[:1, :, :CHECK_HEADS])
            options = {name: _slice_option(name, value, start, end - start) for name, value in case.options.items()}
            arrays, static = _split_arrays(options)

            # One jit: evaluated op by op, every op of the reference compiles (and XLA
            # autotunes its matmuls) at this row's shapes, minutes at T = 8k with a bias.
            @jax.jit
            def reference_rows(qs, ks, vs, dos, arrays):
                out, vjp = jax.vjp(lambda q_: reference.attention(q_, ks, vs, **arrays, **static), qs)
                return out if mode == "fwd" else vjp(dos)[0]

            self._cache = {key: np.asarray(reference_rows(qs, ks, vs, dos, arrays))}
        return self._cache[key]

    def expected_kv_grads(self, case: Case, q, k, v, do):
        """(dk, dv) [1, T, CHECK_HEADS, D] of batch row 0 from every query row, or None with
        dropout (the reference would draw a chunk's keep mask from its own row 0)."""
        import jax.numpy as jnp

        if case.options.get("dropout_rate"):
            return None
        key = (case, "kv")
        if key not in self._cache:
            f32 = lambda x: x.astype(jnp.float32)
            heads = lambda x: f32(x[:1, :, :CHECK_HEADS])
            rows_options = functools.partial(_chunk_options, case)
            operands, _ = _split_arrays(case.options)
            self._cache[key] = benchmark.reference_kv_grads(heads(q), heads(k), heads(v), heads(do), rows_options,
                                                            operands, chunk=self.chunk)
        return self._cache[key]

    def check(self, case: Case, mode: str, result, q, k, v, do) -> dict:
        start, end = _rows(case)
        got = result if mode == "fwd" else result[0]
        errors = {"out" if mode == "fwd" else "dq": benchmark.rel_err(
            got[:1, start:end, :CHECK_HEADS], self.expected(case, mode, q, k, v, do))}
        kv = self.expected_kv_grads(case, q, k, v, do) if mode == "fwdbwd" and len(result) == 3 else None
        if kv is not None:
            errors.update(dk=benchmark.rel_err(result[1][:1, :, :CHECK_HEADS], kv[0]),
                          dv=benchmark.rel_err(result[2][:1, :, :CHECK_HEADS], kv[1]))
        return errors


def measure(case: Case, impl: str, mode: str, args, checker: VariantChecker, reps: int) -> dict:
    """{"status", and "ms", "dense_tflops", "rel_err" or "error"} of one implementation on one case."""
    import jax

    c = cell(case, mode, impl)
    try:
        fn, arrays = implementation(case, impl, *args[:3])
    except NotImplementedError as e:
        return dict(status="unsupported", error=benchmark.short_error(e))
    except ImportError as e:
        return dict(status="unavailable", error=benchmark.short_error(e))
    try:
        compiled, _ = benchmark.compile_cell(c, fn, args, operands=arrays)
        errors = checker.check(case, mode, compiled(*args), *args)
        if not all(err < benchmark.TOLERANCE for err in errors.values()):  # nan fails too
            return dict(status="mismatch", rel_err=errors, error=f"rel err {errors} >= {benchmark.TOLERANCE}")
        median, _, _ = benchmark.median_time(lambda: compiled(*args), jax.block_until_ready, reps=reps)
    except Exception as e:  # a peer without the variant, or out of memory, is recorded, not fatal
        return dict(status="oom" if benchmark.is_oom(e) else "error", error=benchmark.short_error(e))
    dense = benchmark.flops(case.batch, case.heads, case.seq, case.seq, case.head_dim, False, mode)
    return dict(status="ok", ms=median * 1e3, dense_tflops=dense / median / 1e12, rel_err=errors)


MARKS = {"unsupported": "n/a", "unavailable": "not run", "mismatch": "MISMATCH", "error": "err", "oom": "oom"}


def _line(row: dict) -> str:
    def value(impl, mode):
        ms = row.get(f"{impl}_{mode}_ms")
        return f"{ms:.3f}" if ms is not None else MARKS.get(row.get(f"{impl}_{mode}_status"), "-")

    cells = " | ".join(f"{value(i, 'fwd'):>10s} {value(i, 'fwdbwd'):>9s}" for i in IMPLS)
    return f"{row['variant']:22s} {row['seq']:6d} {row['batch']:2d} | {cells}"


def header() -> str:
    names = " | ".join(f"{i + ' fwd':>10s} {'fwd+bwd':>9s}" for i in ("triton", "hopper", *PEERS))
    return f"{'variant':22s} {'T':>6s} {'B':>2s} | {names}   (ms)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="results .json or directory (default benchmarks/results/)")
    parser.add_argument("--quick", action="store_true", help="windows up to T = 16k only")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (>= 10 for the protocol)")
    parser.add_argument("--smoke", action="store_true", help="CPU-sized: H=2, D=32, T <= 512, 2 reps")
    parser.add_argument("--only", default=None, help="comma-separated substrings: the variants whose name holds one; "
                        "'NAME@T' for one sequence length (e.g. 'bias@8192,mask (doc@16384')")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    parser.add_argument("--merge", action="store_true",
                        help="keep the existing results file's rows and cells that this run does not measure")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if unknown := set(impls) - set(IMPLS):
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    if args.smoke:
        args.reps = min(args.reps, 2)
    warnings.filterwarnings("ignore")
    import jax

    import flashjax

    device = jax.devices()[0].device_kind
    checker = VariantChecker()
    print(header())
    selected = cases(args.quick, args.smoke, args.only)
    out = benchmark.results_path(RESULTS_DIR, args.out, device, prefix="variants-", smoke=args.smoke)
    today = datetime.date.today().isoformat()
    # With --merge, the file's rows in their order: a row measured now replaces the cells of
    # the implementations measured (each with its date), keeping the others; new rows follow.
    rows, date = [], today
    if args.merge and out.exists():
        previous = json.loads(out.read_text())
        rows, date = previous["rows"], previous.get("date", today)
    index = {(r["variant"], r["seq"], r["batch"]): i for i, r in enumerate(rows)}
    for case in selected:
        inputs = benchmark.make_inputs(cell(case, "fwd", "flashjax"))
        key = (case.name, case.seq, case.batch)
        row = dict(rows[index[key]]) if key in index else dict(date=today)
        row.update(variant=case.name, seq=case.seq, batch=case.batch, heads=case.heads, head_dim=case.head_dim,
                   useful_fraction=case.visible, baseline=case.baseline)
        for impl in impls:
            # This implementation's cells only ("flashjax_" is also the start of "flashjax_mosaic_").
            own = (*(f"{impl}_{mode}_" for mode in MODES), f"{impl}_date")
            for name in [k for k in row if k.startswith(own)]:
                del row[name]
            for mode in MODES:
                started = time.perf_counter()
                result = measure(case, impl, mode, inputs, checker, args.reps)
                # Progress on stderr: a run cut short still shows where its time went.
                print(f"  {case.name} T={case.seq} {impl} {mode}: {result['status']} "
                      f"{result.get('ms', float('nan')):.3f} ms ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
                row.update({f"{impl}_{mode}_{name}": value for name, value in result.items()})
            row[f"{impl}_date"] = today
        # The row's date: its cells' common date (cells of another day keep their own).
        dates = {row.get(f"{impl}_date", row.get("date")) for impl in IMPLS if f"{impl}_fwd_status" in row}
        if len(dates) == 1:
            row["date"] = dates.pop()
            for impl in IMPLS:
                row.pop(f"{impl}_date", None)
        if key in index:
            rows[index[key]] = row
        else:
            index[key] = len(rows)
            rows.append(row)
        print(_line(row), flush=True)
        # Written after every row: a run cut short keeps what it measured.
        result = dict(device=device, jax=jax.__version__, flashjax=flashjax.__version__, host=platform.node(),
                      date=date, rows=rows,
                      protocol=dict(dtype="bfloat16", reps=args.reps, check_rows=benchmark.CHECK_ROWS,
                                    check_heads=CHECK_HEADS, tolerance=benchmark.TOLERANCE,
                                    flops="dense 4*B*H*T*T*D, x3.5 fwd+bwd"))
        benchmark.save_results(out, result)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
