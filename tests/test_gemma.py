"""Flax's Gemma example (from the Flax sdist) with flashjax attention equals the original.

`examples/gemma_flashjax.py` runs the example's ``modules.Attention`` through
`flashjax.flash_attention` (window and softcap as options, padding as lengths or
segment ids). On tiny configs of both families --

* Gemma 2: attention-logit softcap, local (window 4) and global layers
  alternating, grouped-query heads (4 query heads over 2 kv heads);
* Gemma 3: qk-norm, 5 local : 1 global layers, multi-query heads (4 over 1, like
  gemma3_270m) --

the flashjax model (same parameters) gives the original's logits and parameter
gradients within float32 rounding on padded and packed batches, its greedy
sampler (token by token through the KV cache) generates the original's tokens,
and, where the example's own decoding departs from its forward pass (a local
layer decoding past its window, see the adapter's docstring), its decoded logits
equal the original's uncached forward pass.

On the CPU the kernels run in Pallas interpret mode (``backend="triton"``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jaxtyping", reason="Flax's Gemma example imports jaxtyping (pip install -e '.[test]')")
pytest.importorskip("sentencepiece", reason="Flax's Gemma sampler imports sentencepiece (pip install -e '.[test]')")

from flax import nnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import flax_sdist  # noqa: E402

# float32: the kernels' online softmax and the example's einsums round differently
# (~1e-7 observed on logits, ~1e-6 on the smallest gradients).
RTOL = 1e-5
VOCAB = 64
SEQ = 16
BACKEND = "triton"  # the Pallas kernels (interpret mode on a CPU), never the XLA fallback


@pytest.fixture(scope="module")
def gemma():
    try:
        flax_sdist.flax_sdist()
    except flax_sdist.SdistUnavailable as err:
        pytest.skip(f"Flax's Gemma example comes from its sdist, which is not available here: {err}")
    spec = importlib.util.spec_from_file_location("gemma_flashjax", ROOT / "examples" / "gemma_flashjax.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(gemma, family: str, **override):
    cfg = gemma.transformer_cfg.TransformerConfig
    small = dict(num_embed=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=16, sliding_window_size=4)
    if family == "gemma2":
        # softcap 1.0 instead of 50: the tiny model's logits are O(1), so tanh bends them.
        small.update(num_layers=2, num_kv_heads=2, attn_logits_soft_cap=1.0)
        make = cfg.gemma2_2b
    elif family == "gemma3":
        small.update(num_layers=6, num_kv_heads=1)
        make = cfg.gemma3_270m
    elif family == "gemma1":  # multi-head (the qkv_einsum path), no window, no softcap
        small.update(num_layers=1, num_kv_heads=4)
        small.pop("sliding_window_size")
        make = cfg.gemma_2b
    else:
        raise ValueError(family)
    return make(**{**small, **override})


def models(gemma, config):
    original = gemma.transformer_lib.Transformer(config, rngs=nnx.Rngs(0))
    return original, gemma.to_flashjax(original, backend=BACKEND)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def batch(gemma, kind: str):
    """tokens, positions, loss weights [B, T] and a CausalMask for a padded or packed batch."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, VOCAB, (3, SEQ))
    if kind == "right_padded":  # kv_lengths
        lengths = np.array([SEQ, 11, 5])
        valid = np.arange(SEQ)[None, :] < lengths[:, None]
        mask = gemma.CausalMask(kv_lengths=jnp.asarray(lengths))
        segments = None
    elif kind == "left_padded_packed":  # input_mask + segment ids
        valid = np.ones((3, SEQ), bool)
        valid[1, :6] = False  # left padding
        valid[2, 13:] = False  # right padding after two packed sequences
        segments = np.ones((3, SEQ), np.int32)
        segments[2, 7:] = 2
        segments[~valid] = 0
        mask = gemma.CausalMask(input_mask=jnp.asarray(valid), segment_ids=jnp.asarray(segments))
    else:
        raise ValueError(kind)
    tokens = np.where(valid, tokens, 0)
    if segments is None:
        positions = gemma.transformer_lib.build_positions_from_mask(jnp.asarray(valid))
    else:  # positions restart in every packed sequence, as the example's packing does
        starts = np.concatenate([np.ones((3, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
        index = np.arange(SEQ)[None, :].repeat(3, 0)
        positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid), mask


def loss_logits_grads(model, tokens, positions, attention_mask, weights):
    """Masked next-token cross entropy; (loss, logits, parameter gradients), jitted."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params, rest, attention_mask):
        def loss_fn(params):
            logits, _ = nnx.merge(graphdef, params, rest)(tokens, positions, None, attention_mask)
            logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
            w = weights[:, 1:] & weights[:, :-1]
            return jnp.sum(nll * w) / jnp.sum(w), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, logits, grads

    return run(params, rest, attention_mask)


@pytest.mark.parametrize("kind", ["right_padded", "left_padded_packed"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_logits_and_gradients_equal_original(gemma, family, kind):
    original, flash = models(gemma, tiny_config(gemma, family))
    tokens, positions, valid, mask = batch(gemma, kind)
    loss_o, logits_o, grads_o = loss_logits_grads(original, tokens, positions, mask.dense(SEQ), valid)
    loss_f, logits_f, grads_f = loss_logits_grads(flash, tokens, positions, mask, valid)

    keep = np.asarray(valid)[..., None]  # padded rows are not compared: the loss ignores them
    err = rel_err(np.where(keep, logits_f, 0), np.where(keep, logits_o, 0))
    assert err <= RTOL, f"logits: relative error {err:.2e}"
    assert abs(float(loss_f) - float(loss_o)) <= RTOL * abs(float(loss_o))

    flat_o = dict(nnx.to_flat_state(grads_o))
    flat_f = dict(nnx.to_flat_state(grads_f))
    assert flat_o.keys() == flat_f.keys()
    errors = {"/".join(map(str, path)): rel_err(flat_f[path][...], flat_o[path][...]) for path in flat_o}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, f"gradient of {worst}: relative error {errors[worst]:.2e}"
    attn_grads = [p for p in errors if "attn" in p]
    assert attn_grads and all(np.any(np.asarray(flat_o[p][...]) != 0) for p in flat_o if "attn" in str(p))


@pytest.mark.parametrize("family", ["gemma1", "gemma2"])
def test_dense_attention_mask_equals_original(gemma, family):
    """The example's own [B, T, T] mask (a plain array) is accepted as is: flashjax's mask option."""
    original, flash = models(gemma, tiny_config(gemma, family))
    tokens, positions, valid, mask = batch(gemma, "right_padded")
    dense = mask.dense(SEQ)
    want = jax.jit(lambda t, p, m: original(t, p, None, m)[0])(tokens, positions, dense)
    got = jax.jit(lambda t, p, m: flash(t, p, None, m)[0])(tokens, positions, dense)
    keep = np.asarray(valid)[..., None]
    err = rel_err(np.where(keep, got, 0), np.where(keep, want, 0))
    assert err <= RTOL, f"logits: relative error {err:.2e}"


class TinyVocab:
    """What the example's Sampler asks of a SentencePiece vocabulary (no model file needed)."""

    def pad_id(self):
        return 0

    def bos_id(self):
        return 1

    def eos_id(self):
        return -1  # never generated: every row decodes the full length

    def EncodeAsIds(self, text):  # noqa: N802 (SentencePiece's name)
        return [2 + ord(c) % (VOCAB - 2) for c in text]

    def DecodeIds(self, ids):  # noqa: N802
        return " ".join(map(str, ids))


PROMPTS = ["flash attention", "gemma"]  # 16 and 6 tokens with BOS


def sample(gemma, model, steps: int, cache_size: int):
    sampler = gemma.sampler_lib.Sampler(vocab=TinyVocab(), cache_size=cache_size, transformer=model)
    return sampler(PROMPTS, total_generation_steps=steps, echo=True, return_logits=True)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_sampler_generates_the_original_tokens(gemma, family):
    # Window 32 >= the cache: the example's decoding bands its local layers on cache
    # slot indices (see the adapter's docstring), which agrees with the true window
    # only while no token is past it.
    config = tiny_config(gemma, family, sliding_window_size=32)
    original, flash = models(gemma, config)
    want = sample(gemma, original, steps=8, cache_size=32)
    got = sample(gemma, flash, steps=8, cache_size=32)
    assert got.tokens == want.tokens
    assert len(got.tokens[0]) == len(PROMPTS[0]) + 1 + 8
    for g, w in zip(got.logits, want.logits):
        assert rel_err(g, w) <= RTOL


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_decoding_past_the_window_equals_the_forward_pass(gemma, family):
    """Window 4, 24 tokens decoded through the cache: each step's logits equal the
    original's uncached forward pass over the generated sequence."""
    config = tiny_config(gemma, family)
    original, flash = models(gemma, config)
    out = sample(gemma, flash, steps=8, cache_size=32)
    for prompt, tokens, logits in zip(PROMPTS, out.tokens, out.logits):
        tokens = jnp.asarray(tokens)[None]  # BOS, the prompt, then 8 generated tokens
        length = tokens.shape[1]
        valid = tokens != 0  # a generated pad id is masked by the sampler too
        want, _ = original(tokens, jnp.arange(length)[None], None,
                           gemma.transformer_lib.make_causal_attn_mask(valid))
        # logits[i] (the sampler's buffer, echo=True) predicted token i from the tokens before it.
        err = rel_err(np.asarray(logits)[1:], want[0, :-1])
        assert err <= RTOL, f"{prompt!r}: decoded logits vs forward pass, relative error {err:.2e}"
        assert length > config.sliding_window_size + 8


@pytest.mark.slow
def test_benchmark_smoke(gemma, tmp_path):
    """benchmarks/gemma.py --smoke: both variants train a step in their own processes and agree."""
    import json
    import subprocess

    out = tmp_path / "gemma.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gemma.py"), "--smoke", "--seqlens", "64", "--steps", "1",
           "--warmup", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"original", "flashjax"}
    for row in rows.values():
        assert row["status"] == "ok" and row["tokens_per_s"] > 0, row
    # bfloat16 activations: the two attentions round differently, ~1e-4 relative on the loss.
    assert abs(rows["flashjax"]["loss"] - rows["original"]["loss"]) <= 2e-3 * abs(rows["original"]["loss"])
