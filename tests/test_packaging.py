"""Packaging and the user's first steps: what setup.py installs, version, licence,
citation, model options, and progress reports outside absl's app.run."""
import inspect
import os
import re
import runpy

import numpy as np
import pytest
import setuptools

import dpmm_jax
from dpmm_jax.models import coupled, diag, full, linear, mahalanobis, tied
from experiments import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_kwargs():
  """The keyword arguments setup.py passes to setuptools.setup (nothing is built)."""
  captured = {}
  original = setuptools.setup
  setuptools.setup = lambda **kw: captured.update(kw)
  cwd = os.getcwd()
  try:
    os.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
  finally:
    setuptools.setup = original
    os.chdir(cwd)
  return captured


def test_only_the_library_is_installed(setup_kwargs):
  packages = setup_kwargs["packages"]
  assert "dpmm_jax" in packages and "dpmm_jax.models" in packages
  assert not [p for p in packages if not p.startswith("dpmm_jax")], packages


def test_metadata_version_licence_citation(setup_kwargs):
  assert setup_kwargs["version"] == dpmm_jax.__version__  # one source
  assert setup_kwargs["long_description_content_type"] == "text/markdown"
  assert "## API tour" in setup_kwargs["long_description"]
  assert setup_kwargs["license"] == "Apache-2.0"
  assert "scikit-learn" in " ".join(setup_kwargs["extras_require"]["sklearn"])
  # scikit-learn stays optional: importing dpmm_jax does not need it.
  assert "scikit-learn" not in " ".join(setup_kwargs["install_requires"])
  licence = open(os.path.join(ROOT, "LICENSE")).read()
  assert "Apache License" in licence and "Version 2.0, January 2004" in licence
  cff = open(os.path.join(ROOT, "CITATION.cff")).read()
  assert "cff-version:" in cff and "preferred-citation:" in cff
  assert ("A Bayesian Nonparametric Perspective on Mahalanobis Distance for Out of "
          "Distribution Detection") in cff
  assert not re.search(r"^version:", cff, re.M)  # the version lives in dpmm_jax only


def test_model_options_match_the_fit_signatures():
  not_options = {"stats", "x", "y", "num_classes", "key", "independent"}
  fits = {"mds": mahalanobis.fit, "rmds": mahalanobis.fit, "tied": tied.fit,
          "full": full.fit, "diag": diag.fit, "coupled": coupled.fit,
          "msp": linear.fit, "temp_msp": linear.fit}
  for model, fit in fits.items():
    params = set(inspect.signature(fit).parameters) - not_options
    if model in ("mds", "rmds"):
      params -= {"pseudo_count"}  # only the independent (per-class) covariances use it
    assert set(dpmm_jax.MODEL_OPTIONS[model]) == params, model
  assert set(dpmm_jax.MODEL_OPTIONS["indep_rmds"]) == {"pseudo_count", "rtol"}
  assert set(dpmm_jax.MODEL_OPTIONS) == set(dpmm_jax.MODELS)


def test_unknown_option_names_the_model_and_its_options():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(40, 3)).astype(np.float32)
  y = np.repeat(np.arange(4), 10)
  with pytest.raises(TypeError, match=r"\['max_iter'\] for model 'tied'; its options are "
                     r"rtol"):
    dpmm_jax.fit_detector(x, y, "tied", max_iter=5)
  with pytest.raises(TypeError, match=r"'msp'; its options are num_steps, learning_rate"):
    dpmm_jax.fit_detector(x, y, "msp", tol=1e-3)


def test_readme_lists_every_models_options():
  readme = open(os.path.join(ROOT, "README.md")).read()
  for model, options in dpmm_jax.MODEL_OPTIONS.items():
    row = [line for line in readme.splitlines() if line.startswith(f"| `{model}` |")]
    assert row, model
    for option in options:
      assert f"`{option}`" in row[0], (model, option)


def test_progress_is_printed_outside_app_run(capsys):
  from absl import logging  # pylint: disable=g-import-not-at-top
  assert not logging.level_info()  # pytest: absl hides INFO, as in a notebook
  progress = common.Progress(2, "unit", every_s=0)
  progress.update(message="a")
  progress.update(message="b")
  err = capsys.readouterr().err
  assert "unit: 1/2 done" in err and "unit: 2/2 done" in err and "(b)" in err
