"""Executes every notebook top to bottom at small sizes (DPMM_JAX_NOTEBOOK_QUICK=1)."""
import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_notebooks_exist():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "synthetic_experiments.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, monkeypatch, tmp_path):
  monkeypatch.setenv("DPMM_JAX_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(path, as_version=4)
  # Notebooks hold no model or metric code: they call the library and the experiments.
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert "jax.numpy" not in cell.source and "logsumexp" not in cell.source, cell.source
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": os.path.dirname(path)}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "quick mode" in text
  if os.path.basename(path) == "quickstart.ipynb":
    assert "AUROC" in text and "alpha =" in text
  # Figures were produced (inline images or saved PNGs shown with display(Image)).
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert images, "no figure in the notebook's outputs"
