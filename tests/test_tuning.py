"""The per-backend tuning tables: what `MosaicConfig.default` / `TritonConfig.default` read,
and what `flashjax.tuning` (run by `benchmarks/tune.py`) writes. No GPU needed: the tables
are plain JSON; the search itself is exercised on the CPU in interpret mode."""

import json

import jax.numpy as jnp
import pytest

from flashjax import KernelConfig, MosaicConfig, TritonConfig, benchmark, tuning
from flashjax.kernels.mosaic import config as mosaic_config

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def mosaic_table(tmp_path, monkeypatch):
    """A throwaway copy of the Hopper table that MosaicConfig.default reads."""
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"default": json.loads(mosaic_config.TUNED.read_text())["default"]}))
    monkeypatch.setattr(mosaic_config, "TUNED", path)
    yield path


def test_builtin_tables_have_every_head_dim():
    for head_dim in (64, 128, 256):
        assert MosaicConfig.default(head_dim, device_kind="") == MosaicConfig(
            **{k: v for k, v in tuning.entry(mosaic_config.TUNED, head_dim, None).items()})
    for head_dim in (16, 32, 64, 128, 256):
        config = TritonConfig.default(head_dim, jnp.bfloat16, device_kind="")
        assert all(isinstance(c, KernelConfig) for c in (config.fwd, config.dkv, config.dq))


def test_default_reads_this_gpus_entry(mosaic_table):
    table = json.loads(mosaic_table.read_text())
    table["nvidia-h100-80gb-hbm3"] = {"128": {"block_kv": 64, "stages": 4, "_source": "test"}}
    table["nvidia-h200"] = {"128": {"block_kv": 128, "stages": 3}}
    mosaic_table.write_text(json.dumps(table))
    tuning._table.cache_clear()
    h100 = MosaicConfig.default(128, device_kind=H100)
    assert (h100.block_kv, h100.stages) == (64, 4)
    # Fields the entry does not name keep the built-in value.
    assert h100.dq_block_kv == MosaicConfig.default(128, device_kind="").dq_block_kv
    assert MosaicConfig.default(128, device_kind="NVIDIA H200").stages == 3
    # Another head dim, or a GPU with no entry: the built-in default.
    assert MosaicConfig.default(64, device_kind=H100) == MosaicConfig.default(64, device_kind="")
    assert MosaicConfig.default(128, device_kind="NVIDIA A100-SXM4-80GB") == MosaicConfig.default(128, device_kind="")
    # A head dim between the supported ones reads its padded entry.
    assert MosaicConfig.default(96, device_kind=H100) == h100


def test_an_invalid_entry_is_refused(mosaic_table):
    table = json.loads(mosaic_table.read_text())
    table["nvidia-h100-80gb-hbm3"] = {"128": {"block_kv": 96}}
    mosaic_table.write_text(json.dumps(table))
    tuning._table.cache_clear()
    with pytest.raises(ValueError, match="block_kv"):
        MosaicConfig.default(128, device_kind=H100)


def test_write_entry_is_what_default_reads(mosaic_table):
    winner = MosaicConfig(block_kv=64, stages=3, dq_block_kv=64, bwd_stages=3)
    fields = ["block_kv", "stages", "dq_block_kv", "bwd_stages"]
    tuning.write_entry(mosaic_table, H100, 128, {f: getattr(winner, f) for f in fields}, "test")
    tuning.write_entry(mosaic_table, H100, 64, {f: getattr(MosaicConfig(), f) for f in fields}, "test")  # keeps 128
    got = MosaicConfig.default(128, device_kind=H100)
    assert {f: getattr(got, f) for f in fields} == {f: getattr(winner, f) for f in fields}
    assert set(json.loads(mosaic_table.read_text())["nvidia-h100-80gb-hbm3"]) == {"64", "128"}


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
def test_triton_default_halves_float32_tiles(head_dim):
    """float32 tiles are half the bf16 ones at every head dim: their FMA dots unroll per tile,
    and the bf16 tiling at head dim 64 (128 x 128) took minutes to compile on an H100."""
    bf16 = TritonConfig.default(head_dim, jnp.bfloat16, device_kind="")
    f32 = TritonConfig.default(head_dim, jnp.float32, device_kind="")
    for got, base in [(f32.fwd, bf16.fwd), (f32.dkv, bf16.dkv), (f32.dq, bf16.dq)]:
        assert (got.block_q, got.block_k) == (max(16, base.block_q // 2), max(16, base.block_k // 2))
        assert got.block_q * got.block_k <= 64 * 64


def test_fit_shared_memory_counts_streamed_query_tiles():
    """A loop that streams Q and dO tiles too (the dbias kernel over a broadcast bias's axes):
    the H100 default dQ tiling at head dim 128 (bf16 Q, dO, K, V and bias tiles) sheds stages,
    then key rows, until every stage fits the budget; block_q never changes."""
    from flashjax.kernels.triton.config import SHARED_MEMORY_BUDGET

    base = TritonConfig.default(128, jnp.bfloat16, device_kind="").dq
    per_key, per_query, pair = (128 + 128) * 2, (128 + 128) * 2, 2
    assert base.fit_shared_memory(per_key, pair) == base  # K and V alone fit
    fitted = base.fit_shared_memory(per_key, pair, streamed_bytes_per_query=per_query)
    assert fitted != base and fitted.block_q == base.block_q
    used = fitted.num_stages * (fitted.block_k * (per_key + fitted.block_q * pair) + fitted.block_q * per_query)
    assert used <= SHARED_MEMORY_BUDGET


def test_triton_default_refuses_large_head_dims():
    with pytest.raises(ValueError, match="head_dim"):
        TritonConfig.default(512, jnp.bfloat16, device_kind="")


def test_search_checks_and_times_each_candidate():
    """The search end to end on the CPU (interpret mode): every candidate is checked against
    the reference before it is timed, and one that computes the wrong thing gets no score."""
    import flashjax

    cell = benchmark.Cell("smoke", 2, 1, 32, 128, True, "fwd", "flashjax", tokens=256)
    good = TritonConfig.default(32, jnp.float32, device_kind="")
    small = TritonConfig(KernelConfig(16, 16), KernelConfig(16, 16), KernelConfig(16, 16))

    def make_call(cell, candidate):
        if candidate == "wrong":  # a "candidate" that drops the causal mask
            return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=False, backend="triton")
        return lambda q, k, v: flashjax.flash_attention(q, k, v, causal=cell.causal, config=candidate)

    results = tuning.search([cell], [good, small, "wrong"], make_call, reps=2, compile_workers=1)
    assert [r["score"] is not None for r in results] == [True, True, False]
    assert all(run["rel_err"]["out"] < benchmark.TOLERANCE for r in results[:2] for run in r["runs"])
    assert "mismatch" in results[2]["runs"][0]["error"]
