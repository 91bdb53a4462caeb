"""Flax integration: a drop-in `attention_fn` and multi-head attention modules.

One-line change in an existing model::

  nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=flashjax.flax.attention_fn)   # linen
  nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False, rngs=rngs,
                         attention_fn=flashjax.flax.attention_fn)                        # nnx

Modules of our own, with grouped-query attention and a KV cache of kv heads:
`flashjax.flax.linen.FlashMultiHeadAttention`, `flashjax.flax.nnx.FlashMultiHeadAttention`.
"""

from flashjax.flax import linen, nnx
from flashjax.flax.attention_fn import attention_fn, make_attention_fn

__all__ = ["attention_fn", "make_attention_fn", "linen", "nnx"]
