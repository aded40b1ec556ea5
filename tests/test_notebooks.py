"""Executes every notebook top to bottom at small sizes (DPMM_JAX_NOTEBOOK_QUICK=1):
from the checkout, and (the library-only ones) from a bare directory outside it, as on a
fresh Colab runtime, against the installed package."""
import glob
import os
import shutil

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
BYOE = "bring_your_own_embeddings.ipynb"


def _run(path, cwd, monkeypatch, env=()):
  monkeypatch.setenv("DPMM_JAX_NOTEBOOK_QUICK", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("DPMM_JAX_REPO", raising=False)
  for key, value in env:
    monkeypatch.setenv(key, value)
  nb = nbformat.read(path, as_version=4)
  # Notebooks hold no model or metric code: they call the library and the experiments.
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert "jax.numpy" not in cell.source and "logsumexp" not in cell.source, cell.source
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": cwd}})
  client.execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  text += "".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
  assert "quick mode" in text
  # Figures were produced (inline images or saved PNGs shown with display(Image)).
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert images, "no figure in the notebook's outputs"
  return text


def test_notebooks_exist_with_install_cell_and_stored_outputs():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {"quickstart.ipynb", "synthetic_experiments.ipynb", BYOE} <= names
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    install = nb.cells[1].source
    # One marked variable for installs outside a checkout; jax is never reinstalled.
    assert 'DPMM_JAX_REPO = ""  # <-- SET THIS' in install and "--no-deps" in install
  byoe = nbformat.read(os.path.join(ROOT, "notebooks", BYOE), as_version=4)
  stored = [o for c in byoe.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert [o for o in stored if "image/png" in o.get("data", {})], "BYOE needs stored figures"
  assert "full size" in "".join(o.get("text", "") for o in stored)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_in_checkout(path, monkeypatch):
  text = _run(path, os.path.dirname(path), monkeypatch)
  assert f"repository: {ROOT}" in text
  if os.path.basename(path) == "quickstart.ipynb":
    assert "AUROC" in text and "alpha =" in text
  if os.path.basename(path) == BYOE:
    assert "AUROC" in text and "loaded scores identical: True" in text


@pytest.mark.parametrize("name", ["quickstart.ipynb", BYOE])
def test_notebook_runs_without_checkout(name, monkeypatch, tmp_path):
  """A bare directory: the notebook finds no checkout and uses the installed package;
  the BYOE notebook gets the repository (for the shipped data) from DPMM_JAX_REPO."""
  path = shutil.copy(os.path.join(ROOT, "notebooks", name), tmp_path / name)
  env = [("DPMM_JAX_REPO", ROOT)] if name == BYOE else []
  text = _run(str(path), str(tmp_path), monkeypatch, env)
  if name == BYOE:
    assert f"repository: {ROOT}" in text and "loaded scores identical: True" in text
  else:
    assert "repository: None" in text and "AUROC" in text
