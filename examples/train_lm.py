"""Train a small decoder-only transformer (Flax nnx + optax) with flashjax or Flax attention.

The data is synthetic and generated on the device, so nothing is downloaded:
each sequence is an arithmetic progression modulo the vocabulary,
``x_t = (start + step * t) mod vocab``, with a random start and step per
sequence. The first token says nothing about the step, so the model must learn
to look back at earlier tokens (attention) to predict the next one: the loss
falls from ``log(vocab)`` towards 0.

Both attention choices build the same parameters from the same seed and see
the same batches, so their loss curves agree up to float rounding:

* ``--attention flash``: `flashjax.flax.nnx.FlashMultiHeadAttention(causal=True)`;
* ``--attention flax``: `flax.nnx.MultiHeadAttention` called with ``is_causal=True``
  (Flax's default attention, which materialises the T x T scores).

Examples::

  python examples/train_lm.py --attention flash --seq-len 8192 --batch 2 --steps 200 --dtype bfloat16
  python examples/train_lm.py --attention flax --seq-len 256 --steps 50 --out flax.json

Prints the loss and tokens/s with a progress bar, the device's peak memory where
it reports one (GPUs), and writes a JSON summary with ``--out``. A run that
exhausts the device memory is reported (``"oom": true``) instead of crashing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
try:
    from tqdm.auto import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None

from flashjax.flax.nnx import FlashMultiHeadAttention


# ---- data -----------------------------------------------------------------------------
class _NoBar:
    """What the loop uses of a tqdm bar, without one."""

    def __init__(self, iterable):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def set_postfix(self, **_):
        pass

    def close(self):
        pass


def make_batch(key, batch: int, seq_len: int, vocab: int):
    """Arithmetic progressions mod ``vocab``: int32 ``[batch, seq_len + 1]`` (inputs + next token)."""
    k_start, k_step = jax.random.split(key)
    start = jax.random.randint(k_start, (batch, 1), 0, vocab)
    step = jax.random.randint(k_step, (batch, 1), 1, vocab)
    return (start + step * jnp.arange(seq_len + 1)[None, :]) % vocab


# ---- model ----------------------------------------------------------------------------
class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args, *, rngs: nnx.Rngs):
        d, dtype = args.d_model, _dtype(args.dtype)
        self.attention_kind = args.attention
        self.norm1 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        common = dict(num_heads=args.heads, in_features=d, num_kv_heads=args.kv_heads, dtype=dtype,
                      use_bias=False, rngs=rngs)
        if args.attention == "flash":
            self.attention = FlashMultiHeadAttention(**common, causal=True)
        else:
            self.attention = nnx.MultiHeadAttention(**common, decode=False)
        self.norm2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.mlp_in = nnx.Linear(d, 4 * d, dtype=dtype, use_bias=False, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d, d, dtype=dtype, use_bias=False, rngs=rngs)

    def __call__(self, x, decode: bool = False):
        """``x`` ``[batch, seq, d_model]``; ``decode``: ``seq`` new positions through the KV cache."""
        h = self.norm1(x)
        if self.attention_kind == "flash" or decode:
            x = x + self.attention(h, decode=decode)
        else:
            x = x + self.attention(h, is_causal=True)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class DecoderLM(nnx.Module):
    """Token + learned position embeddings, ``layers`` blocks, a final norm and an unembedding."""

    def __init__(self, args, *, rngs: nnx.Rngs):
        dtype = _dtype(args.dtype)
        self.embed = nnx.Embed(args.vocab, args.d_model, dtype=dtype, rngs=rngs)
        self.positions = nnx.Embed(args.seq_len, args.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(args, rngs=rngs) for _ in range(args.layers)])
        self.norm = nnx.RMSNorm(args.d_model, dtype=dtype, rngs=rngs)
        self.unembed = nnx.Linear(args.d_model, args.vocab, dtype=dtype, use_bias=False, rngs=rngs)

    def __call__(self, tokens, start=0, decode: bool = False):
        """int ``[batch, seq]`` at positions ``start ...`` -> float32 logits ``[batch, seq, vocab]``.

        ``decode``: the tokens continue the sequence held in the KV caches (``init_cache``
        first; ``start`` is the number of tokens already there).
        """
        x = self.embed(tokens) + self.positions(start + jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x, decode=decode)
        return self.unembed(self.norm(x)).astype(jnp.float32)

    def init_cache(self, batch: int, max_len: int, dtype):
        """Empty KV caches for ``batch`` sequences of up to ``max_len`` tokens, in ``dtype``."""
        for block in self.blocks:
            block.attention.init_cache((batch, max_len, self.embed.features), dtype=dtype)


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


# ---- training -------------------------------------------------------------------------
@nnx.jit
def train_step(model, optimizer, tokens):
    """One AdamW step on next-token cross-entropy; returns the loss before the update."""

    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=["flash", "flax"], default="flash")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write a JSON summary here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs every 10%% instead)")
    args = p.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


def peak_memory_bytes():
    """The device's peak memory in use so far, or None where it does not report it (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def train(args) -> dict:
    """Runs the training loop; returns the summary (also written to ``args.out``)."""
    model = DecoderLM(args, rngs=nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.0), wrt=nnx.Param)
    data_key = jax.random.key(args.seed + 1)
    tokens_per_step = args.batch * args.seq_len
    summary = {
        "attention": args.attention,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")},
        "device": str(jax.devices()[0].device_kind),
        "params": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "losses": [],
        "oom": False,
    }
    times = []
    if tqdm is None:
        args.no_progress = True
        bar = _NoBar(range(args.steps))
    else:
        bar = tqdm(range(args.steps), desc=f"{args.attention} T={args.seq_len}", disable=args.no_progress,
                   file=sys.stdout)
    try:
        for step in bar:
            tokens = make_batch(jax.random.fold_in(data_key, step), args.batch, args.seq_len, args.vocab)
            start = time.perf_counter()
            loss = float(train_step(model, optimizer, tokens))  # float() waits for the step
            times.append(time.perf_counter() - start)
            summary["losses"].append(loss)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / times[-1]:,.0f}")
            if args.no_progress and (step + 1) % max(1, args.steps // 10) == 0:
                print(f"step {step + 1:5d}  loss {loss:.4f}  {tokens_per_step / times[-1]:,.0f} tokens/s")
    except jax.errors.JaxRuntimeError as err:  # report running out of memory, re-raise the rest
        if "RESOURCE_EXHAUSTED" not in str(err) and "out of memory" not in str(err).lower():
            raise
        summary["oom"] = True
        summary["error"] = str(err).splitlines()[0][:300]
        print(f"out of memory at step {len(times)}: {summary['error']}")
    bar.close()

    # The first step compiles; steady-state speed is the median of the others.
    steady = sorted(times[1:]) or times
    step_time = steady[len(steady) // 2] if steady else math.nan
    summary.update(
        compile_and_first_step_s=times[0] if times else None,
        median_step_s=step_time,
        tokens_per_s=tokens_per_step / step_time,
        peak_memory_bytes=peak_memory_bytes(),
    )
    if summary["losses"]:
        print(f"{args.attention}: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f}, "
              f"{summary['tokens_per_s']:,.0f} tokens/s (median step {step_time * 1e3:.1f} ms)")
    if summary["peak_memory_bytes"] is not None:
        print(f"peak device memory: {summary['peak_memory_bytes'] / 2**30:.2f} GiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def main(argv=None) -> dict:
    return train(parse_args(argv))


if __name__ == "__main__":
    main()
