"""Smoke test of examples/train_lm.py on the CPU: both attention choices train alike.

The two models are built from the same seed (`FlashMultiHeadAttention` creates
its parameters in the same order and with the same initialisers as
`nnx.MultiHeadAttention`) and see the same batches, so in float32 their loss
curves differ only by the attention's rounding (~1e-6 relative per call). AdamW
normalises the updates, which lets such differences grow a little from step to
step; after a few steps they stay well below 1e-4 relative, the tolerance here.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
TINY = ["--seq-len", "32", "--batch", "4", "--steps", "8", "--d-model", "32", "--layers", "2",
        "--heads", "4", "--kv-heads", "2", "--lr", "3e-3", "--no-progress"]
LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flash_and_flax_losses_agree(train_lm, tmp_path):
    runs = {}
    for attention in ("flash", "flax"):
        out = tmp_path / f"{attention}.json"
        train_lm.main(TINY + ["--attention", attention, "--out", str(out)])
        runs[attention] = json.loads(out.read_text())
    flash, flax = (np.asarray(runs[a]["losses"]) for a in ("flash", "flax"))
    assert flash.shape == flax.shape == (8,)
    np.testing.assert_allclose(flash, flax, rtol=LOSS_RTOL)
    assert flash[-2:].mean() < flash[0], f"loss did not decrease: {flash}"
    for summary in runs.values():
        assert not summary["oom"] and summary["tokens_per_s"] > 0
        assert summary["config"]["kv_heads"] == 2
