"""Attention kernels. Each backend module exposes `forward` and `backward` with the
signatures of `flashjax.kernels.triton`; nothing here imports the public API."""
