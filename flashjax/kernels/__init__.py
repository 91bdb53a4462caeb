"""Attention backends: `triton` and `mosaic` (Pallas kernels) and `xla` (the reference).

Each builds a `flashjax.backends.Backend`; nothing here imports the public API."""
