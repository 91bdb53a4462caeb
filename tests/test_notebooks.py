"""The notebooks run top to bottom on the CPU (outputs are stripped in the repository).

Each notebook is executed with nbclient in a kernel that runs this interpreter
(`sys.executable`), declared in a temporary kernelspec: no `ipykernel install`
is needed on a fresh machine where only `pip install -e .[test]` has run.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "flashjax-test-python"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "flashjax tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))  # searched before the user's and system dirs
    return KERNEL


@pytest.mark.parametrize("name", ["quickstart.ipynb", "benchmarks.ipynb"])
def test_notebook_runs(name, kernel_name):
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), (
        f"{name}: outputs must be stripped before committing"
    )
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_name, timeout=300, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
