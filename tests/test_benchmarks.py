"""Smoke runs of the benchmark scripts on the CPU (interpret mode, tiny problems): the code
paths of `flashjax bench` (benchmarks/attention.py), benchmarks/tune.py and benchmarks/decode.py, end to end,
into temporary directories. Speed means nothing here; the records' statuses and checks do."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import benchmark, cli, tuning

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(jax.default_backend() == "gpu", reason="the --smoke runs are CPU-sized"),
]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"flashjax_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def test_bench_smoke(tmp_path, capsys):
    """flashjax bench --smoke: every cell checked against the reference, timed, recorded."""
    out = tmp_path / "bench.json"
    argv = ["--smoke", "--quiet", "--causal", "yes", "--impls", "flashjax,flashjax_mosaic,xla", "--out", str(out)]
    assert cli.main(["bench", *argv]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 2 * 2 * 3  # T in {128, 256} x {fwd, fwdbwd} x impls
    for key, cell in cells.items():
        if cell["impl"] == "flashjax_mosaic":  # the Hopper kernels have no interpret mode
            assert cell["status"] == "unsupported" and "sm90" in cell["error"], key
        else:
            assert cell["status"] == "ok", (key, cell.get("error"))
            assert max(cell["rel_err"].values()) < benchmark.TOLERANCE and cell["median_ms"] > 0
    assert "smoke" in capsys.readouterr().out  # the table


def test_bench_ab_smoke(tmp_path, capsys):
    """--ab: the config variant measured as IMPL~ab beside its impl, both checked, every cell
    of a row timed in interleaved rounds (their medians recorded); bad --ab flags stop first."""
    bench = _script("attention")
    out = tmp_path / "ab.json"
    argv = ["--smoke", "--quiet", "--causal", "no", "--modes", "fwd", "--impls", "flashjax,xla",
            "--ab", "flashjax:fwd.num_warps=2", "--out", str(out)]
    assert bench.main(argv) == 0
    cells = json.loads(out.read_text())["cells"]
    assert sorted({c["impl"] for c in cells.values()}) == ["flashjax", "flashjax~ab", "xla"]
    for key, cell in cells.items():
        assert cell["status"] == "ok", (key, cell.get("error"))
        assert len(cell["rounds_ms"]) == 3 and cell["median_ms"] * 1e-3 > 0
        assert min(cell["rounds_ms"]) <= cell["median_ms"] <= max(cell["rounds_ms"])
        assert cell.get("config_overrides") == ("fwd.num_warps=2" if cell["impl"] == "flashjax~ab" else None), key
    assert "flashjax~ab / flashjax" in capsys.readouterr().out
    for bad in (["--ab", "flashjax:fwd.num_warps=2"],  # no --out
                ["--ab", "cudnn:block_q=64", "--out", str(out)],
                ["--ab", "flashjax:fwd.no_such_field=1", "--out", str(out)]):
        with pytest.raises(SystemExit):
            bench.main(["--smoke", "--quiet", "--impls", "flashjax", *bad])


def test_smoke_runs_never_write_the_committed_results():
    """Without --out a smoke run's tiny cells go under the system's temporary directory, not
    into benchmarks/results (whose files the README's tables are built from): every script's
    results path passes its smoke flag."""
    results = BENCHMARKS / "results"
    assert benchmark.results_path(results, None, "cpu", prefix="ring-", smoke=True).parent == benchmark.SMOKE_DIR
    assert benchmark.results_path(results, None, "cpu", prefix="ring-").parent == results
    assert benchmark.results_path(results, "/x/y.json", "cpu", smoke=True) == Path("/x/y.json")
    for script in sorted(BENCHMARKS.glob("*.py")):
        if '"--smoke"' not in script.read_text():
            continue
        for call in script.read_text().split("results_path(")[1:]:
            assert "smoke=args.smoke" in call.split("\n")[0] + call.split("\n")[1], script.name


def test_readme_tables_are_those_the_committed_results_give(tmp_path):
    """plot.py --readme rebuilds the README's generated tables from benchmarks/results: on the
    committed files it changes nothing (a separate run's file, e.g. a dated ring run, stays
    out of the tables)."""
    copy = tmp_path / "README.md"
    copy.write_text((BENCHMARKS.parent / "README.md").read_text())
    assert _script("plot").main(["--readme", str(copy)]) == 0
    assert copy.read_text() == (BENCHMARKS.parent / "README.md").read_text()


def test_tune_smoke(tmp_path):
    """tune.py --smoke: candidates searched, the winners written into a copy of the Triton table."""
    table = tmp_path / "tuned.json"
    assert _script("tune").main(["--smoke", "--out", str(tmp_path), "--table", str(table)]) == 0
    device = jax.devices()[0].device_kind
    entry = json.loads(table.read_text())[tuning.device_slug(device)]["32"]
    assert set(entry) == {"fwd", "dkv", "dq", "_source"}
    assert "default" in json.loads(table.read_text())  # the copy started from the package's table
    report = json.loads(benchmark.results_path(tmp_path, None, device, prefix="tuning-").read_text())["runs"][-1]
    for kernel in ("fwd", "dkv", "dq"):
        default = report["results"][f"32/{kernel}"][0]  # the current tiling leads
        assert default["score"] is not None and all("rel_err" in run for run in default["runs"])


def test_decode_smoke(tmp_path, capsys):
    """decode.py --smoke: every cache kind checked against the reference, timed, recorded;
    peers that need a GPU (or are not installed) recorded as such."""
    out = tmp_path / "decode.json"
    assert _script("decode").main(["--smoke", "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 4 * 6  # caches x impls, one batch and context
    for key, cell in cells.items():
        runs = cell["impl"] in ("flashjax", "xla") or (cell["impl"] == "pallas_gqa" and cell["cache"] == "contiguous")
        if runs:
            assert cell["status"] == "ok", (key, cell.get("error"))
            assert max(cell["rel_err"].values()) < benchmark.TOLERANCE and cell["tb_per_s"] > 0
        else:
            assert cell["status"] in ("unsupported", "unavailable"), (key, cell)
    assert "effective bandwidth" in capsys.readouterr().out  # the table
    # The README's decode plot from these cells: a PNG beside the JSON.
    pytest.importorskip("matplotlib")
    png = _script("plot").plot_decode(out)
    assert png == tmp_path / "decode.png" and png.stat().st_size > 10_000


def test_flex_smoke(tmp_path, capsys):
    """flex.py --smoke on the cases that take every code path (a mask_mod with a built-in and a
    block-mask build row, a score_mod with a learned table, sinks, MLA dims): each flashjax cell
    checked against the reference and timed, the visible fraction counted, the ratios summarised;
    the torch cells recorded with a reason when torch is not installed (its runner otherwise),
    the Hopper kernels' cells recorded as unsupported here with the reason."""
    flex = _script("flex")
    out = tmp_path / "flex.json"
    cases = ["causal_document", "t5_bias", "sinks", "mla"]
    assert flex.main(["--smoke", "--cases", ",".join(cases), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cells = data["cells"]
    expected_impls = {
        "causal": {"flashjax_builtin"},  # the plain call of sinks and MLA (and the block-mask row's forward)
        "causal_document": {"flashjax", "flashjax_builtin", "flashjax_mosaic", "flashjax_mosaic_builtin", "torch_flex"},
        "t5_bias": {"flashjax", "flashjax_mosaic", "torch_flex"},
        "sinks": {"flashjax"},
        "mla": {"flashjax"},
    }
    torch_installed = importlib.util.find_spec("torch") is not None
    for name, impls in expected_impls.items():
        for mode in ("fwd", "fwdbwd"):
            for impl in impls:
                key = benchmark.cell_key(name, 128, flex.CASES[name].causal, mode, impl)
                cell = cells[key]
                if impl.startswith("flashjax_mosaic"):  # no Hopper GPU here
                    assert cell["status"] == "unsupported" and cell["error"], (key, cell)
                elif impl != "torch_flex":
                    assert cell["status"] == "ok", (key, cell.get("error"))
                    assert max(cell["rel_err"].values()) < benchmark.TOLERANCE and cell["median_ms"] > 0
                    assert set(cell["rel_err"]) == ({"out"} if mode == "fwd" else {"dq", "dk", "dv"}), (key, cell)
                    assert 0 < cell["visible"] <= 1 and cell["tflops"] > 0
                elif not torch_installed:
                    assert cell["status"] == "unavailable" and "torch is not installed" in cell["error"], (key, cell)
                else:  # FlexAttention runs eagerly on the CPU, forward only
                    assert cell["status"] == ("ok" if mode == "fwd" else "unsupported"), (key, cell)
    # Exact visible fractions: causal (T + 1) / 2T; the T5 bias masks nothing.
    assert cells["causal/T128/causal/fwd/flashjax_builtin"]["visible"] == 129 / 256
    assert cells["t5_bias/T128/full/fwd/flashjax"]["visible"] == 1.0
    assert cells["mla/T128/causal/fwd/flashjax"]["v_head_dim"] == flex.SMOKE_SIZES.mla_dims[1]
    for impl in flex.BUILD_IMPLS:  # the block mask built under jit and eagerly, checked, timed
        build = cells[f"causal_document/T{flex.SMOKE_BLOCK_MASK_SEQ}/causal/build/{impl}"]
        assert build["status"] == "ok" and build["median_ms"] > 0, build
    summary = {(s["case"], s["mode"]): s for s in data["summary"] if s.get("backend", "triton") == "triton"}
    for mode in ("fwd", "fwdbwd"):
        assert summary[("causal_document", mode)]["mod_over_builtin"] > 0
        assert summary[("sinks", mode)]["tflops_vs_plain"] > 0 and summary[("mla", mode)]["tflops_vs_plain"] > 0
    assert summary[("causal_document", "build")]["block_mask_jit_share"] > 0
    text = capsys.readouterr().out
    assert "mod/built-in" in text and "block mask" in text and "bars:" in text  # the tables


def test_variants_smoke(tmp_path):
    """benchmarks/variants.py --smoke on a few rows: checked and timed on the Triton kernels,
    the Hopper kernels recorded as unsupported here, FlashAttention-3 as unavailable where it
    has the variant (not installed: "not run") and unsupported where it has not ("n/a"), a
    second run merged into the first's file, and the README table rendered from it."""
    variants = _script("variants")
    out = tmp_path / "variants.json"
    assert variants.main(["--smoke", "--only", "4 rows,dropout", "--impls", "flashjax,flashjax_mosaic,fa3",
                          "--out", str(out)]) == 0
    assert variants.main(["--smoke", "--only", "segments x4 causal", "--impls", "flashjax", "--merge",
                          "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["variant"] for r in rows) == ["4 rows causal", "dropout 0.1", "segments x4 causal"]
    for row in rows:
        for mode in variants.MODES:
            assert row[f"flashjax_{mode}_status"] == "ok", row
            assert max(row[f"flashjax_{mode}_rel_err"].values()) < benchmark.TOLERANCE
        if row["variant"] != "segments x4 causal":
            assert row["flashjax_mosaic_fwd_status"] == "unsupported"
            assert row["fa3_fwd_status"] == ("unavailable" if row["variant"] == "4 rows causal" else "unsupported")
    table = _script("plot").variants_markdown(json.loads(out.read_text()))
    assert "| segments x4 causal |" in table and "Triton fwd / fwd+bwd" in table


@pytest.mark.parametrize("name", ["causal_document", "document_window", "t5_bias", "sinks", "mla"])
def test_flex_kv_reference_by_chunks(name):
    """flex.py's dk / dv reference over chunks of query rows (each chunk's mods, causal mask
    and window stated for its own rows) equals the whole-sequence reference's gradients, and
    catches a dk or dv off by 5% on early keys."""
    from flashjax import reference

    flex = _script("flex")
    case, sizes = flex.CASES[name], flex.SMOKE_SIZES
    cell = flex.make_cell(case, 128, "fwdbwd", "flashjax", sizes)
    q, k, v, do = (x.astype(jnp.float32) for x in flex.inputs_for(cell))
    arrays = flex.draw_arrays(case, cell.batch, 128, sizes)
    want = flex.expected_kv(case, sizes, (q, k, v, do), arrays, chunk=32)  # 4 chunks
    options = case.mod(flex.as_jax(arrays), sizes)
    heads = want[0].shape[2]
    row = lambda x: x[:1, :, :heads]
    one_row = {name: value[:heads] if name == "sinks" else value for name, value in options.items()}
    loss = lambda k_, v_: jnp.sum(reference.attention(row(q), k_, v_, **one_row) * row(do))
    exact = jax.grad(loss, argnums=(0, 1))(row(k), row(v))
    errors = flex.check_kv(want, *exact)
    assert max(errors.values()) < 1e-5, errors
    for wrong in (0, 1):
        grads = list(exact)
        grads[wrong] = grads[wrong].at[:, :8].multiply(1.05)
        assert flex.check_kv(want, *grads)[("dk", "dv")[wrong]] > 1e-4, errors


@pytest.mark.parametrize("causal", [False, True])
def test_checker_catches_wrong_kv_gradients(causal):
    """The harness's check of forward+backward covers dk and dv (whole sequence, by chunks of
    query rows), not only dq: exact gradients pass, a dk or dv off by 5% is caught."""
    cell = benchmark.Cell("d32", 4, 2, 32, 1536, causal, "fwdbwd", "flashjax", tokens=3072)  # B = 2, chunks of 512
    q, k, v, do = benchmark.make_inputs(cell, seed=3, dtype=jnp.float32)
    from flashjax import reference

    exact = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, causal=causal) * do), argnums=(0, 1, 2))(q, k, v)
    checker = benchmark.Checker()
    errors = checker.check(cell, exact, q, k, v, do)
    assert set(errors) == {"dq", "dk", "dv"} and max(errors.values()) < 1e-5, errors
    for wrong in (1, 2):
        grads = list(exact)
        grads[wrong] = grads[wrong].at[:, :200].multiply(1.05)  # early keys: no checked query row's dq sees this
        errors = checker.check(cell, tuple(grads), q, k, v, do)
        assert errors["dq"] < 1e-5 and errors[("dk", "dv")[wrong - 1]] > 1e-3, errors
    assert set(checker.check(cell, exact[:1], q, k, v, do)) == {"dq"}  # a peer that returns dq alone


def test_variant_checker_checks_kv_gradients_by_chunks():
    """variants.py's check of forward+backward covers dk and dv: the reference over chunks of
    query rows, each chunk's causal / window / ALiBi / lengths / ids / mask / bias stated for its
    own rows, equals the whole-sequence reference's gradients on every smoke row (dropout aside:
    dq only), and a dk or dv off by 5% on early keys is caught."""
    from flashjax import reference

    variants = _script("variants")
    checker = variants.VariantChecker()
    checker.chunk = 64  # several chunks at the smoke lengths
    heads = variants.CHECK_HEADS
    for case in variants.cases(False, smoke=True):
        if case.seq > 256:  # the same options at 512
            continue
        cell = variants.cell(case, "fwdbwd", "flashjax")
        q, k, v, do = benchmark.make_inputs(cell, dtype=jnp.float32)
        options = {name: value[:1] if name in ("q_lengths", "kv_lengths") else value for name, value in case.options.items()}
        if "segment_ids" in options:
            options["segment_ids"] = options["segment_ids"][:1]
        if "alibi_slopes" in options:
            options["alibi_slopes"] = options["alibi_slopes"][:heads]
        if "bias" in options or "mask" in options:
            name = "bias" if "bias" in options else "mask"
            options[name] = options[name][:1, :heads] if options[name].shape[1] > 1 else options[name][:1]
        row = lambda x: x[:1, :, :heads]
        loss = lambda q_, k_, v_: jnp.sum(reference.attention(q_, k_, v_, **options) * row(do))
        exact = jax.grad(loss, argnums=(0, 1, 2))(row(q), row(k), row(v))
        errors = checker.check(case, "fwdbwd", exact, q, k, v, do)
        if "dropout_rate" in case.options:
            assert set(errors) == {"dq"}, (case.name, errors)
            continue
        assert set(errors) == {"dq", "dk", "dv"} and max(errors.values()) < 1e-5, (case.name, errors)
        for wrong in (1, 2):
            grads = list(exact)
            grads[wrong] = grads[wrong].at[:, :8].multiply(1.05)
            assert checker.check(case, "fwdbwd", tuple(grads), q, k, v, do)[("dk", "dv")[wrong - 1]] > 1e-4, case.name


def test_flops_of_causal_calls_with_other_query_lengths():
    """Bottom-right causal pairs: Tq*Tk - Tq^2/2 (Tq <= Tk), Tk^2/2 (Tq > Tk), T^2/2 when square."""
    per_pair = 4 * 2 * 3 * 64  # 4 * B * H * D
    assert benchmark.flops(2, 3, 1024, 4096, 64, True) == per_pair * (1024 * 4096 - 1024 ** 2 / 2)
    assert benchmark.flops(2, 3, 4096, 1024, 64, True) == per_pair * 1024 ** 2 / 2
    assert benchmark.flops(2, 3, 4096, 4096, 64, True, "fwdbwd") == 3.5 * per_pair * 4096 ** 2 / 2
    assert benchmark.flops(2, 3, 1024, 4096, 64, False) == per_pair * 1024 * 4096
    # Against a count of the visible pairs (the protocol's halving of the square's triangle).
    tq, tk = 48, 80
    visible = sum(min(tk, max(0, i + tk - tq + 1)) for i in range(tq))
    assert abs(benchmark.flops(1, 1, tq, tk, 1, True) / 4 - visible) <= tq / 2


def test_variants_table_marks_and_baseline_ratio():
    """The variants table: "not run" for a peer not installed in a row's run, "n/a" for one
    without the variant; the last column divides one backend's times (the faster on the row)
    by that same backend's on the baseline row."""
    def row(variant, triton, hopper, fa3=None, **extra):
        r = {"variant": variant, "seq": 8192, "batch": 2, "heads": 16, "head_dim": 128, "useful_fraction": 1.0,
             "baseline": "full"}
        for impl, times in (("flashjax", triton), ("flashjax_mosaic", hopper), ("fa3", fa3)):
            if times:
                r[f"{impl}_fwd_ms"], r[f"{impl}_fwdbwd_ms"] = times
        return {**r, **extra}

    rows = [row("full", (2.0, 8.0), (1.0, 6.0), fa3_fwd_status="unavailable"),
            row("padded", (0.5, 2.0), (0.8, 3.0), fa3_fwd_status="unsupported", fa3_fwd_error="fa3 has no such option"),
            row("windowed", (1.0, 4.0), (0.5, 3.0), fa3=(0.4, 2.0))]
    table = _script("plot").variants_markdown({"rows": rows, "date": "d", "device": "GPU", "jax": "0"})
    lines = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ")}
    assert "not run" in lines["full"] and "n/a" in lines["padded"] and "not run" not in lines["padded"]
    assert "| 0.25 / 0.25 of full |" in lines["padded"]  # Triton 0.5 / 2.0 on the row over Triton's 2.0 / 8.0
    assert "| 0.50 / 0.50 of full |" in lines["windowed"]  # Hopper on both rows


def test_inner_calls():
    """The protocol's few back-to-back calls per repetition; with span_s, as many as fill it
    (never fewer than the few, at most MOST_INNER_CALLS)."""
    assert [benchmark.inner_calls(s) for s in (1e-4, 5e-3, 2e-2, 0.1)] == [5, 3, 2, 1]
    assert benchmark.inner_calls(4e-4, span_s=0.02) == 50
    assert benchmark.inner_calls(1e-3, span_s=0.02) == 20
    assert benchmark.inner_calls(1e-5, span_s=0.02) == benchmark.MOST_INNER_CALLS
    assert benchmark.inner_calls(0.1, span_s=0.02) == 1 and benchmark.inner_calls(5e-3, span_s=1e-3) == 3


def test_ncu_profile_cells():
    """ncu_profile.py's cells (SEQ:causal[:LEFT]) and the pairs a sliding window scores."""
    ncu = _script("ncu_profile")
    assert ncu.parse_cells("8192:no,32768:yes:4096") == [(8192, False, None), (32768, True, 4096)]
    for seq, causal, window in [(100, False, None), (100, True, None), (100, True, 10), (5, True, 10)]:
        rows = np.arange(seq)
        want = np.minimum(rows + 1, window + 1) if window else rows + 1 if causal else np.full(seq, seq)
        assert ncu.visible_pairs(seq, causal, window) == want.sum()


def test_ncu_profile_summary(tmp_path, capsys):
    """benchmarks/ncu_profile.py summarize: each kernel's time from ncu's raw CSV, per marked
    window, and the TFLOP/s its products perform with each product's own head dim (MLA)."""
    ncu = _script("ncu_profile")
    assert ncu.parse_dims("128,192x128") == [(128, 128), (192, 128)]
    batch, seq = 4, 4096
    # dK/dV at 192 / 128, causal: S^T and dK over 192, dP^T and dV over 128.
    dkv_flops = 2 * batch * ncu.HEADS * seq ** 2 * (2 * 192 + 2 * 128) * 0.5
    rows = [["Kernel Name", "gpu__time_duration.sum"], ["", "msecond"], [ncu.MARKER, "0.001"],
            ["flashjax_mosaic_dkv_mosaic_gpu_kernel", "1.25"], ["flashjax_mosaic_dq_mosaic_gpu_kernel", "0.5"]]
    raw = tmp_path / "raw.csv"
    raw.write_text("==PROF== a line ncu logs\n" + "\n".join(",".join(f'"{x}"' for x in r) for r in rows) + "\n")
    windows = tmp_path / "windows.json"
    windows.write_text(json.dumps([dict(seq=seq, causal=True, impl="mosaic", batch=batch, head_dim=192, v_head_dim=128)]))
    ncu.main(["summarize", str(raw), "--windows", str(windows)])
    text = capsys.readouterr().out
    assert "## D=192x128 T=4096 causal mosaic: 2 kernels, 1.750 ms" in text
    dkv_line = next(line for line in text.splitlines() if "dkv" in line)
    assert f"{dkv_flops / 1.25e-3 / 1e12:.1f} TFLOP/s" in dkv_line, dkv_line


def test_device_trace_summary(tmp_path):
    """benchmarks/device_trace.py: per GPU and per call, the time kernels run, the time NCCL
    kernels run and the part of it under a kernel, from a perfetto trace (copies ignored,
    overlapping events on several streams counted once)."""
    import gzip

    trace = _script("device_trace")
    meta = lambda pid, name: dict(ph="M", name="process_name", pid=pid, args=dict(name=name))
    event = lambda pid, tid, name, ts, dur: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur)
    events = [
        meta(1, "/device:GPU:0"), meta(2, "/device:GPU:1"), meta(9, "/host:CPU"),
        # GPU 0: kernels 0-100 and 50-120 (two streams: 120 us of kernels), a copy, NCCL 100-200
        # (20 us under the second kernel), both calls' worth.
        event(1, 7, "flashjax_mosaic_fwd_mosaic_gpu_kernel", 0, 100),
        event(1, 8, "flashjax_mosaic_fwd_mosaic_gpu_kernel", 50, 70),
        event(1, 7, "MemcpyD2H", 120, 5),
        event(1, 8, "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 100, 100),
        # GPU 1: NCCL entirely under a kernel.
        event(2, 7, "flashjax_fwd", 0, 200), event(2, 8, "ncclDevKernel_SendRecv", 20, 40),
        event(9, 1, "host work", 0, 1000),  # not a device
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=events), f)
    summary = trace.summarize(path, calls=2)
    assert set(summary) == {0, 1}
    assert summary[0] == pytest.approx(dict(span=0.1, kernels=0.06, collectives=0.05, hidden=0.01))
    assert summary[1] == pytest.approx(dict(span=0.1, kernels=0.1, collectives=0.02, hidden=0.02))
    mean = trace.mean_over_devices(summary)
    assert mean["hidden"] == pytest.approx(0.015)
    assert "(0.01 under a kernel, 0.02 exposed)" in trace.describe(summary)
    assert trace.describe({}) == "trace: no GPU events"


def test_ring_smoke_with_trace(tmp_path):
    """benchmarks/ring.py --smoke (2 CPU host devices, in its own process: the device count is
    fixed when JAX starts) with --trace: every cell checked and timed, each ring entry traced."""
    import os
    import subprocess

    out = tmp_path / "ring.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(BENCHMARKS / "ring.py"), "--smoke", "--out", str(out), "--trace",
                    str(tmp_path / "traces")], check=True, env=env, capture_output=True, timeout=600)
    entries = json.loads(out.read_text())["entries"]
    assert len(entries) == 8 and all(e["status"] == "ok" for e in entries), entries
    assert all(e["trace"] == {} for e in entries if e["impl"] == "ring")  # no GPU events on a CPU
    assert all("trace" not in e for e in entries if e["impl"] == "single")
