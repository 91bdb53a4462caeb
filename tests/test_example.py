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


GENERATE = EXAMPLE.with_name("generate.py")
# Odd prompt length, a prefill chunk that does not divide it, GQA, float32 (no near-ties).
TINY_GENERATE = ["--context", "37", "--new-tokens", "7", "--batch", "3", "--prefill-chunk", "16",
                 "--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "64"]


@pytest.fixture(scope="module")
def generate():
    import sys

    sys.path.insert(0, str(GENERATE.parent))  # generate.py imports train_lm's model
    spec = importlib.util.spec_from_file_location("generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_with_cache_matches_without(generate, tmp_path):
    """examples/generate.py: greedy tokens with the KV cache (flashjax's decode path, prompt
    in chunks) equal the tokens of re-running the whole sequence per token, and those of
    the same model with Flax's attention and its cache (prompt token by token)."""
    runs = {}
    for name, attention, extra in (("flash", "flash", []), ("flax", "flax", []),
                                   ("flash-long-cache", "flash", ["--cache-len", "75"])):
        out = tmp_path / f"{name}.json"
        generate.main(TINY_GENERATE + ["--attention", attention, "--check", "--out", str(out)] + extra)
        runs[name] = json.loads(out.read_text())
    assert all(run["matches_no_cache"] for run in runs.values())
    assert runs["flash"]["tokens"] == runs["flax"]["tokens"] == runs["flash-long-cache"]["tokens"]
    assert runs["flash-long-cache"]["config"]["cache_len"] == 75
    assert np.asarray(runs["flash"]["tokens"]).shape == (2, 7)


def test_generate_one_new_token(generate, tmp_path):
    """One new token in all (the prefill's, no decode step): the token of generation without a cache."""
    out = tmp_path / "one.json"
    generate.main(TINY_GENERATE + ["--new-tokens", "1", "--check", "--out", str(out)])
    run = json.loads(out.read_text())
    assert run["matches_no_cache"] and np.asarray(run["tokens"]).shape == (2, 1)
