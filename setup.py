"""Install dpmm_jax: hierarchical Gaussian DPMMs for out-of-distribution detection in JAX.

Only the library (``dpmm_jax``) is installed. The experiment binaries in ``experiments/``
are run from a checkout (``python -m experiments.demo`` from the repository root), so a
generic top-level ``experiments`` package never lands in site-packages.
"""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
  """The version, read from dpmm_jax/__init__.py (its one source)."""
  with open(os.path.join(HERE, "dpmm_jax", "__init__.py")) as f:
    match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
  if not match:
    raise RuntimeError("No __version__ in dpmm_jax/__init__.py.")
  return match.group(1)


with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
  LONG_DESCRIPTION = f.read()

setup(
    name="dpmm_jax",
    version=_version(),
    description=("Out-of-distribution detection with hierarchical Gaussian Dirichlet-process "
                 "mixture models (a Bayesian nonparametric view of the Mahalanobis score)."),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    # No public repository URL yet: add url= / project_urls "Source" when published.
    project_urls={"Paper's reference implementation": "https://github.com/rwl93/bnp4ood"},
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["dpmm_jax", "dpmm_jax.*"]),
    python_requires=">=3.10",
    # jax/jaxlib 0.10.x run batched CPU LAPACK kernels (Cholesky, triangular solves,
    # eigh) on XLA's intra-op pool and block pool threads on their sub-tasks: two such
    # kernels running at once on a 2-core machine deadlock (seen in the full-covariance
    # model at D >= 256). 0.9.2 and releases that build this path out are fine.
    install_requires=["jax>=0.9.2,!=0.10.*", "jaxlib>=0.9.2,!=0.10.*", "optax", "numpy",
                      "chex", "matplotlib", "absl-py", "threadpoolctl"],
    extras_require={
        "sklearn": ["scikit-learn>=1.6"],
        "test": ["pytest", "pytest-xdist", "scipy", "scikit-learn>=1.6", "hypothesis",
                 "nbclient", "nbformat", "ipykernel"],
    },
    keywords=["out-of-distribution detection", "Dirichlet process", "mixture model",
              "Mahalanobis distance", "JAX", "Bayesian nonparametrics"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Science/Research",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
