"""Flax's source distribution (its tests and examples), fetched once into a cache.

The Flax wheel ships only the library; its tests (``tests/``) and examples
(``examples/gemma``, ...) are in the sdist on PyPI. This module downloads the
sdist of the installed Flax version with pip and unpacks it into
``${FLASHJAX_CACHE:-~/.cache/flashjax}/flax-<version>/``, reusing it when present,
so that flashjax's tests and examples can run Flax's own code against flashjax
without copying it into this repository::

    from flax_sdist import flax_sdist
    root = flax_sdist()                 # Path(.../flax-0.12.10)
    gemma = root / "examples" / "gemma"

Also a script: ``python examples/flax_sdist.py`` prints the path (downloading if needed).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = ["SdistUnavailable", "cache_dir", "flax_sdist"]


class SdistUnavailable(RuntimeError):
    """The sdist is neither cached nor downloadable (no network, no pip, a bad archive)."""


def cache_dir() -> Path:
    """``$FLASHJAX_CACHE``, else ``~/.cache/flashjax``."""
    return Path(os.environ.get("FLASHJAX_CACHE") or Path.home() / ".cache" / "flashjax").expanduser()


def installed_flax_version() -> str:
    from importlib.metadata import version

    return version("flax")


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock file: parallel test workers download and unpack once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(version: str, dest: Path, timeout: float) -> Path:
    archive = dest / f"flax-{version}.tar.gz"
    if archive.exists():
        return archive
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"flax=={version}", "--no-deps",
               "--no-binary", ":all:", "--disable-pip-version-check", "-d", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise SdistUnavailable(f"`{' '.join(cmd)}` did not finish: {err}") from err
        found = sorted(Path(tmp).glob("flax-*.tar.gz"))
        if proc.returncode != 0 or not found:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise SdistUnavailable(f"`pip download flax=={version}` failed (exit {proc.returncode}): {tail}")
        os.replace(found[0], archive)
    return archive


def flax_sdist(version: str | None = None, *, timeout: float = 600.0) -> Path:
    """The unpacked sdist of Flax ``version`` (default: the installed Flax), downloaded once.

    Args:
      version: a Flax release, e.g. ``"0.12.10"``; ``None`` for the installed one.
      timeout: seconds allowed for ``pip download``.

    Returns:
      The directory ``<cache>/flax-<version>`` (with ``tests/``, ``examples/``, ...).

    Raises:
      SdistUnavailable: when it is not cached and cannot be downloaded or unpacked.
    """
    version = version or installed_flax_version()
    root = cache_dir()
    target = root / f"flax-{version}"
    if (target / "PKG-INFO").exists():
        return target
    try:
        with _locked(root / f"flax-{version}.lock"):
            if (target / "PKG-INFO").exists():  # another process finished meanwhile
                return target
            archive = _download(version, root, timeout)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                try:
                    with tarfile.open(archive) as tar:
                        tar.extractall(tmp, filter="data")
                except (tarfile.TarError, OSError) as err:
                    archive.unlink(missing_ok=True)  # a truncated download: fetch again next time
                    raise SdistUnavailable(f"cannot unpack {archive}: {err}") from err
                unpacked = Path(tmp) / f"flax-{version}"
                if not (unpacked / "PKG-INFO").exists():
                    raise SdistUnavailable(f"{archive} has no flax-{version}/PKG-INFO")
                shutil.rmtree(target, ignore_errors=True)
                os.replace(unpacked, target)
    except OSError as err:
        raise SdistUnavailable(f"cannot use the cache {root}: {err}") from err
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", nargs="?", default=None, help="a Flax version (default: the installed one)")
    print(flax_sdist(parser.parse_args().version))
