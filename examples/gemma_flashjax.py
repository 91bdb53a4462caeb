"""Flax's Gemma example with its attention computed by `flashjax.flash_attention`.

Flax ships an nnx Gemma (1, 2 and 3) in ``examples/gemma`` of its sdist; its
``modules.Attention`` writes the attention out: logits ``[B, T, N, S]``, an
attention-logit softcap, a sliding-window band on local layers, a padding/causal
mask ``[B, T, S]`` and a softmax. This module fetches that example from the sdist
of the installed Flax (`flax_sdist`, cached under ``${FLASHJAX_CACHE:-~/.cache/flashjax}``),
puts it on ``sys.path`` and provides:

* `FlashAttention`: a subclass of the example's ``modules.Attention`` with the same
  parameters, whose ``__call__`` hands q, k, v to `flashjax.flash_attention`:

  - ``query_pre_attn_scalar`` -> ``scale`` (the example multiplies q by it);
  - ``attn_logits_soft_cap`` -> ``softcap`` (applied to the scaled logits);
  - grouped/multi-query heads -> k, v with ``num_kv_heads`` heads as they are
    (query head ``n`` reads kv head ``n // (num_heads // num_kv_heads)``, the
    example's ``BTKGH`` grouping);
  - the local layers' band -> ``window=(sliding_window_size - 1, 0)`` with
    ``causal=True`` (or ``(w - 1, w - 1)`` around a dense mask, as the example's
    ``triu``/``tril`` band);
  - padding -> `CausalMask`: ``kv_lengths`` (right padding) or segment ids (any
    padding pattern, packed sequences), never a ``[B, T, S]`` array.

* `CausalMask`: passed as the Transformer's ``attention_mask`` in place of
  ``transformer.make_causal_attn_mask(input_mask)`` (its `dense` method builds
  that array for the original model).
* `flash_transformer` / `to_flashjax`: a Gemma ``Transformer`` whose layers use
  `FlashAttention` (new, or sharing an existing model's parameters).

Where a dense mask is still used, and why:

* A plain array as ``attention_mask`` (what the example's ``train.py`` and
  ``sampler.py`` build) is passed on as flashjax's ``mask``: its pattern is
  arbitrary, so nothing else can express it. Use `CausalMask` to avoid it.
* With a KV cache (decoding), the causal limit and the window are relative to the
  query's slot ``end_index + t`` in a fixed-size cache. flashjax aligns
  ``causal`` and ``window`` to the array lengths (query ``i`` sits at key
  ``i + kv_len - q_len``, with ``kv_len`` the cache size, not ``kv_lengths``),
  so they cannot be given as options here: they become a ``[T, S]`` band (one row
  per decoded token) ANDed into the sampler's key mask, and ``kv_lengths =
  end_index + T`` lets the kernels skip the cache's unfilled tiles.

One difference from the example: with a cache, its band is computed on the mask
array's indices (``triu``/``tril`` of the ``[1, S]`` mask row), so a local layer
decoding token ``p >= sliding_window_size`` attends cache slots
``0 .. sliding_window_size - 1`` (the first tokens) instead of the last
``sliding_window_size``; without a cache (training, scoring) it is the usual band.
`FlashAttention` uses the band relative to the query's position in both cases, so
its decoded logits equal the example's uncached forward pass; the two samplers
agree while the generated length stays within the window.

Run ``python examples/gemma_flashjax.py`` for a tiny check: logits of the
original and the flashjax model on a padded batch.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
from flax import nnx

import flashjax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flax_sdist import SdistUnavailable, flax_sdist  # noqa: E402

GEMMA_DIR = flax_sdist() / "examples" / "gemma"
if str(GEMMA_DIR) not in sys.path:
    sys.path.insert(0, str(GEMMA_DIR))

import modules  # noqa: E402  (Flax's examples/gemma, from the sdist)
import positional_embeddings  # noqa: E402
import sampler as sampler_lib  # noqa: E402
import transformer as transformer_lib  # noqa: E402
import transformer_cfg  # noqa: E402

__all__ = [
    "GEMMA_DIR", "SdistUnavailable", "CausalMask", "FlashAttention", "flash_transformer", "to_flashjax",
    "modules", "sampler_lib", "transformer_lib", "transformer_cfg",
]

AttentionType = transformer_cfg.AttentionType


@flax.struct.dataclass
class CausalMask:
    """``make_causal_attn_mask(input_mask)`` (and packing), as flashjax options instead of an array.

    Pass it as the Gemma Transformer's ``attention_mask`` when it runs `FlashAttention`.
    Query ``t`` attends key ``s <= t`` when key ``s`` is a token and, with segment
    ids, of ``t``'s segment -- the example's ``make_causal_attn_mask(input_mask)``
    ANDed with ``segment_ids[:, :, None] == segment_ids[:, None, :]`` as in its
    ``train.py``. Padded query rows attend the keys that this allows, as in the
    example (their outputs are not zeroed: the loss weights ignore them).

    Attributes:
      kv_lengths: int ``[B]``: right padding, the first ``kv_lengths[b]`` tokens
        are real. The cheapest form: the kernels do not load the tiles past it.
      input_mask: bool ``[B, T]``: True for real tokens, any pattern (left padding,
        holes). Becomes key segment ids (a padding key gets segment -1, which no
        query has).
      segment_ids: int ``[B, T]``: packed sequences, a query attends keys of its
        own segment only.
    """

    kv_lengths: jax.Array | None = None
    input_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None

    def flash_options(self) -> dict:
        """The `flashjax.flash_attention` keywords (besides causal and window) for this mask."""
        options = {}
        if self.kv_lengths is not None:
            options["kv_lengths"] = jnp.asarray(self.kv_lengths, jnp.int32)
        if self.input_mask is not None or self.segment_ids is not None:
            base = self.input_mask if self.segment_ids is None else self.segment_ids
            q_ids = (jnp.zeros(base.shape, jnp.int32) if self.segment_ids is None
                     else jnp.asarray(self.segment_ids, jnp.int32))
            kv_ids = q_ids if self.input_mask is None else jnp.where(self.input_mask, q_ids, -1)
            options["segment_ids"] = (q_ids, kv_ids)
        return options

    def dense(self, seq_len: int) -> jax.Array:
        """The example's bool ``[B, T, T]`` attention mask for the same attention (for the original model)."""
        valid = jnp.ones((1, seq_len), jnp.bool_)
        if self.input_mask is not None:
            valid = valid & self.input_mask
        if self.kv_lengths is not None:
            valid = valid & (jnp.arange(seq_len)[None, :] < self.kv_lengths[:, None])
        mask = transformer_lib.make_causal_attn_mask(valid)
        if self.segment_ids is not None:
            mask = mask & (self.segment_ids[:, :, None] == self.segment_ids[:, None, :])
        return mask


class FlashAttention(modules.Attention):
    """The example's ``modules.Attention`` (same constructor, parameters and cache), computed by flashjax.

    ``attn_mask`` may be a `CausalMask` (no cache) or the example's bool array
    ``[B, T, S]`` (with or without a cache). ``flash_backend`` and ``flash_config``
    (instance attributes, default ``"auto"`` and ``None``) go to
    `flashjax.flash_attention` as ``backend`` and ``config``.
    """

    flash_backend: str = "auto"
    flash_config = None

    def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
        if self.sow_config.attn_logits_topk:
            raise NotImplementedError(
                "sow_config.attn_logits_topk sows the attention logits, which flashjax never materialises; "
                "use the example's modules.Attention for that."
            )
        seq_len = x.shape[1]
        if self.use_qkv_einsum:
            query, key, value = self.qkv_einsum(x, out_sharding=self.shd_config.act_sbtnh)
        else:
            query = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
            key, value = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)
        if self.use_qk_norm:
            query = self._query_norm(query)
            key = self._key_norm(key)
        rope = dict(head_dim=self.head_dim, max_wavelength=self.rope_base_frequency,
                    scale_factor=self.rope_scale_factor)
        query = positional_embeddings.apply_rope(query, segment_pos, **rope)
        key = positional_embeddings.apply_rope(key, segment_pos, **rope)

        if cache is not None:  # left-aligned cache, written as in the example
            end_index = cache["end_index"][0]
            start = (0, end_index % cache["v"].shape[1], 0, 0)
            value = jax.lax.dynamic_update_slice(cache["v"], value, start)
            key = jax.lax.dynamic_update_slice(cache["k"], key, start)

        encoded = self._attend(query, key, value, cache, attn_mask, rngs)
        attn_output = self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)
        new_cache = None
        if cache is not None:
            new_cache = {"v": value, "k": key, "end_index": cache["end_index"] + seq_len}
        return new_cache, attn_output

    def _attend(self, query, key, value, cache, attn_mask, rngs):
        batch, seq_q = query.shape[:2]
        seq_k = key.shape[1]
        local = self.attn_type == AttentionType.LOCAL_SLIDING
        width = self.sliding_window_size
        options = dict(
            scale=float(self.query_pre_attn_scalar),
            softcap=None if self.attn_logits_soft_cap is None else float(self.attn_logits_soft_cap),
            backend=self.flash_backend,
            config=self.flash_config,
        )
        if cache is not None:
            if isinstance(attn_mask, CausalMask):
                raise TypeError("with a KV cache, pass the sampler's bool attention mask [B, T, cache_size]")
            # Queries sit at cache slots end_index + t; see the module docstring for why
            # the causal limit and the window are a band here rather than options.
            end_index = cache["end_index"][0]
            slot = jnp.arange(seq_k)[None, :]
            position = end_index + jnp.arange(seq_q)[:, None]
            band = slot <= position
            if local:
                band = band & (position - slot < width)
            options.update(
                mask=(attn_mask.astype(jnp.bool_) & band[None])[:, None],
                kv_lengths=jnp.full((batch,), jnp.minimum(end_index + seq_q, seq_k), jnp.int32),
            )
        elif isinstance(attn_mask, CausalMask):
            options.update(attn_mask.flash_options(), causal=True, window=(width - 1, 0) if local else None)
        else:
            # An arbitrary [B, T, S] mask: passed on; the local band is the example's
            # symmetric |t - s| < width, its causality coming from the mask.
            options.update(mask=attn_mask.astype(jnp.bool_)[:, None],
                           window=(width - 1, width - 1) if local else None)

        dropout = self.dropout
        if dropout.rate > 0.0 and not dropout.deterministic:
            stream = rngs if rngs is not None else dropout.rngs
            if stream is None:
                raise ValueError("dropout needs rngs: pass rngs to the Transformer call")
            key_rng = stream[dropout.rng_collection]() if isinstance(stream, nnx.Rngs) else stream()
            options.update(dropout_rate=float(dropout.rate), dropout_rng=key_rng)

        dtype = jnp.result_type(query, key, value)
        query, key, value = (t.astype(dtype) for t in (query, key, value))
        return flashjax.flash_attention(query, key, value, **options)


@contextlib.contextmanager
def _flash_attention_class():
    """``modules.Block`` builds ``Attention`` by its module-level name: make it `FlashAttention`."""
    original = modules.Attention
    modules.Attention = FlashAttention
    try:
        yield
    finally:
        modules.Attention = original


def _set_options(model, backend: str, config):
    for layer in model.layers:
        if backend != FlashAttention.flash_backend:
            layer.attn.flash_backend = backend
        if config is not None:
            layer.attn.flash_config = config
    return model


def flash_transformer(config, *, rngs: nnx.Rngs, sow_config=None, backend: str = "auto", flash_config=None):
    """A Gemma ``transformer.Transformer(config, rngs=rngs)`` whose attention is `FlashAttention`.

    Built in the same order with the same initialisers as the original, so the same
    ``rngs`` give the same parameters.
    """
    kwargs = {} if sow_config is None else {"sow_config": sow_config}
    with _flash_attention_class():
        model = transformer_lib.Transformer(config, rngs=rngs, **kwargs)
    return _set_options(model, backend, flash_config)


def to_flashjax(model, *, backend: str = "auto", flash_config=None):
    """A Gemma Transformer with `FlashAttention`, sharing ``model``'s parameters (no copy)."""
    abstract = nnx.eval_shape(
        lambda: flash_transformer(model.config, rngs=nnx.Rngs(0), sow_config=model.sow_config))
    nnx.update(abstract, nnx.state(model))
    return _set_options(abstract, backend, flash_config)


def _demo():
    config = transformer_cfg.TransformerConfig.gemma2_2b(
        num_layers=2, num_embed=64, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=16, num_kv_heads=2,
        sliding_window_size=4, attn_logits_soft_cap=1.0)
    original = transformer_lib.Transformer(config, rngs=nnx.Rngs(0))
    flash = to_flashjax(original)
    lengths = jnp.array([12, 7])
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 3, 64)
    mask = CausalMask(kv_lengths=lengths)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    want, _ = original(tokens, positions, None, mask.dense(12))
    got, _ = flash(tokens, positions, None, mask)
    valid = jnp.arange(12)[None, :, None] < lengths[:, None, None]
    err = jnp.linalg.norm(jnp.where(valid, got - want, 0)) / jnp.linalg.norm(jnp.where(valid, want, 0))
    print(f"Gemma 2 (tiny), padded batch: relative logit difference flashjax vs original {float(err):.2e}")


if __name__ == "__main__":
    argparse.ArgumentParser(description="Flax's Gemma example with flashjax attention: a tiny model's logits "
                                        "against the original's (no options).").parse_args()
    _demo()
