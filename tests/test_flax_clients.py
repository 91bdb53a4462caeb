"""Flax's own attention tests, run with flashjax as the modules' default attention.

Fetches the sdist of the installed (pinned) Flax into ``${FLASHJAX_CACHE:-~/.cache/flashjax}``
(reused when present; skipped with the reason when it can be neither found nor
downloaded) and runs two of its test files in a pytest subprocess, with the plugin
``tests/flax_default_attention.py`` making `flashjax.flax.attention_fn` the default
``attention_fn`` of ``nnx.MultiHeadAttention``, ``linen.MultiHeadDotProductAttention``,
``linen.MultiHeadAttention`` and ``linen.SelfAttention``:

* ``tests/linen/linen_attention_test.py``
* ``tests/nnx/nn/attention_test.py``

Every test must pass except those the plugin deselects by name (they sow the
attention weights, which flashjax never materialises). A failure names the Flax
tests that failed, with the first line of each error. The subprocess takes about
as long as the same files with Flax's own attention (~100 s on a 2-core CPU, most
of it compiling).

By hand::

    PYTHONPATH=tests python -m pytest -p flax_default_attention \\
        ~/.cache/flashjax/flax-0.12.10/tests/linen/linen_attention_test.py \\
        ~/.cache/flashjax/flax-0.12.10/tests/nnx/nn/attention_test.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR.parent / "examples"))
import flax_sdist  # noqa: E402  (examples/flax_sdist.py)

import flax_default_attention as plugin  # noqa: E402  (tests/flax_default_attention.py)

PINNED_FLAX = "0.12.10"  # constraints.txt; the counts below are for this release
FLAX_TEST_FILES = ("tests/linen/linen_attention_test.py", "tests/nnx/nn/attention_test.py")
# Flax 0.12.10: 149 tests in the two files, 4 deselected (plugin.DESELECTED).
EXPECTED_PASSED = 145
# Tests in which flashjax's attention_fn ran. The other 30 test Flax's functions
# directly (nn.dot_product_attention, RoPE with an explicit attention_fn, argument
# validation) and never build a module with the default attention.
MIN_TESTS_CALLING_FLASHJAX = 115
TIMEOUT_S = 1800


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, first line of the message)} from a JUnit XML report."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[0:1]
                message = message[0][:300] if message else ""
                break
        outcomes[name] = (outcome, message)
    return outcomes


@pytest.fixture(scope="module")
def flax_source() -> Path:
    import flax

    if flax.__version__ != PINNED_FLAX:
        pytest.fail(
            f"flax {flax.__version__} is installed but this test's expectations are for flax {PINNED_FLAX} "
            "(constraints.txt): update PINNED_FLAX, EXPECTED_PASSED and the plugin's DESELECTED list."
        )
    try:
        return flax_sdist.flax_sdist(PINNED_FLAX)
    except flax_sdist.SdistUnavailable as err:
        pytest.skip(f"Flax's tests come from its sdist, which is not available here: {err}")


@pytest.mark.slow
def test_flax_attention_tests_pass_with_flashjax(flax_source, tmp_path):
    junit, report = tmp_path / "flax.xml", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "flax_default_attention", "-p", "no:cacheprovider",
           "-o", "addopts=", "-q", "-rfE", f"--junitxml={junit}", f"--flashjax-report={report}",
           *FLAX_TEST_FILES]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=flax_source, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    print(f"Flax's attention tests with flashjax: {summary} (subprocess {elapsed:.0f} s)")
    assert junit.exists() and report.exists(), f"pytest subprocess exited {proc.returncode}:\n{output[-4000:]}"

    outcomes = _outcomes(junit)
    bad = {name: v for name, v in outcomes.items() if v[0] != "passed"}
    assert not bad, (
        f"{len(bad)} of Flax's attention tests did not pass with flashjax ({summary}):\n"
        + "\n".join(f"  {outcome.upper()} {name}: {message}" for name, (outcome, message) in sorted(bad.items()))
    )
    assert proc.returncode == 0, output[-4000:]

    info = json.loads(report.read_text())
    deselected = {nodeid.rsplit("::", 2)[-2] + "::" + nodeid.rsplit("::", 1)[-1] for nodeid in info["deselected"]}
    assert deselected == set(plugin.DESELECTED), (
        f"deselected {sorted(deselected)}, expected {sorted(plugin.DESELECTED)}: a test was renamed or removed"
    )
    assert len(outcomes) == EXPECTED_PASSED, f"{len(outcomes)} tests ran, expected {EXPECTED_PASSED} ({summary})"
    calling = [nodeid for nodeid, calls in info["calls"].items() if calls > 0 and "::" in nodeid]
    assert len(calling) >= MIN_TESTS_CALLING_FLASHJAX, (
        f"flashjax's attention_fn ran in only {len(calling)} tests (expected >= {MIN_TESTS_CALLING_FLASHJAX}): "
        "the default attention_fn swap did not take"
    )
