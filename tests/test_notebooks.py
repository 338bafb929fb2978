"""Notebooks run top to bottom (executed with a real kernel, not just parsed) and import grpo_jax only."""

import json
import time
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_is_a_composing_losses_notebook():
    assert ROOT / "notebooks" / "composing_losses.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    assert time.perf_counter() - start < 240, "keep notebooks fast: they run in the test suite"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_never_defines_library_maths(path):
    """Notebooks compose the library's pieces; they do not define their own ratio/surrogate/KL/advantage code."""
    source = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    for name in ("def clipped_surrogate", "def kl_divergence", "def aggregate", "def group_advantages",
                 "def compute_loss", "def completion_logps"):
        assert name not in source, f"{path.name} redefines {name[4:]}: import it from grpo_jax"
    assert "grpo_jax" in source
