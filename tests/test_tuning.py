"""The Hopper kernels' per-GPU tuning table: what `MosaicConfig.default` reads and what
`benchmarks/tune.py --backend mosaic` writes. No GPU needed: the table is plain JSON."""

import itertools
import json
import sys
from pathlib import Path

import pytest

from flashjax import api
from flashjax import config as config_module
from flashjax.config import MosaicConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tune  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def tuning_file(tmp_path, monkeypatch):
    path = tmp_path / "tuned_mosaic.json"
    monkeypatch.setattr(config_module, "MOSAIC_TUNING_FILE", path)
    config_module._mosaic_tuning_table.cache_clear()
    yield path
    config_module._mosaic_tuning_table.cache_clear()


def test_default_without_a_table_is_the_builtin(tuning_file):
    assert MosaicConfig.default(128, device_kind=H100) == config_module._MOSAIC_TUNED[128]


def test_default_reads_this_gpus_entry(tuning_file):
    tuning_file.write_text(json.dumps({
        "nvidia-h100-80gb-hbm3": {"128": {"block_kv": 64, "stages": 4, "not_a_field": 1, "_source": "test"}},
        "nvidia-h200": {"128": {"block_kv": 128, "stages": 3}},
    }))
    h100 = MosaicConfig.default(128, device_kind=H100)
    assert (h100.block_kv, h100.stages) == (64, 4)
    # Fields the entry does not name keep the built-in value; unknown keys are ignored.
    assert h100.dq_block_kv == config_module._MOSAIC_TUNED[128].dq_block_kv
    assert MosaicConfig.default(128, device_kind="NVIDIA H200").stages == 3
    # Another head dim, or a GPU with no entry: the built-in table.
    assert MosaicConfig.default(64, device_kind=H100) == config_module._MOSAIC_TUNED[64]
    assert MosaicConfig.default(128, device_kind="NVIDIA A100-SXM4-80GB") == config_module._MOSAIC_TUNED[128]


def test_an_invalid_entry_is_refused(tuning_file):
    tuning_file.write_text(json.dumps({"nvidia-h100-80gb-hbm3": {"128": {"block_kv": 96}}}))
    with pytest.raises(ValueError, match="block_kv"):
        MosaicConfig.default(128, device_kind=H100)


def test_tune_writes_what_default_reads(tuning_file):
    winner = MosaicConfig(block_kv=64, stages=3, dq_block_kv=64, bwd_stages=3)
    fields = [f for group in tune.MOSAIC_GROUPS.values() for f in group]
    tune.update_mosaic_table(tuning_file, H100, 128, winner, fields, "test")
    tune.update_mosaic_table(tuning_file, H100, 64, MosaicConfig(), fields, "test")  # keeps the 128 entry
    config_module._mosaic_tuning_table.cache_clear()
    got = MosaicConfig.default(128, device_kind=H100)
    assert {f: getattr(got, f) for f in fields} == {f: getattr(winner, f) for f in fields}
    assert set(json.loads(tuning_file.read_text())["nvidia-h100-80gb-hbm3"]) == {"64", "128"}


def test_mosaic_candidates_vary_only_their_group():
    default = MosaicConfig.default(128, device_kind="cpu")
    for group, fields in tune.MOSAIC_GROUPS.items():
        cands = tune.mosaic_candidates(default, group, cap=100)
        assert cands[0] == default and len(set(cands)) == len(cands)
        others = [f for g, fs in tune.MOSAIC_GROUPS.items() if g != group for f in fs]
        assert all(getattr(c, f) == getattr(default, f) for c in cands for f in others)
        assert len(cands) == len(list(itertools.product(*fields.values())))


def test_tune_smoke_checks_and_times_each_candidate(tmp_path):
    """The Triton search end to end on the CPU (interpret mode): every candidate is checked
    against the reference before it is timed, and the winner is one that ran."""
    out = tmp_path / "tuning.json"
    assert tune.main(["--smoke", "--kernels", "fwd", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = [run for cand in report["results"]["32/fwd"] for run in cand["runs"]]
    assert runs and all(run["rel_err"]["out"] < 2e-2 and run["tflops"] > 0 for run in runs)
    assert report["tuned"]["32"][0] in [cand["config"] for cand in report["results"]["32/fwd"]]


@pytest.mark.skipif(api._is_hopper(), reason="on a Hopper GPU the search runs for real")
def test_tune_mosaic_leaves_the_table_alone_without_hopper(tuning_file, tmp_path):
    """On a machine without an sm90 GPU no candidate runs: nothing is written to the table."""
    tune.main(["--backend", "mosaic", "--smoke", "--out", str(tmp_path / "t.json")])
    assert not tuning_file.exists()
