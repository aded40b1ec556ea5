"""Install dpmm_jax: hierarchical Gaussian DPMMs for out-of-distribution detection in JAX."""
from setuptools import find_packages, setup

setup(
    name="dpmm_jax",
    version="0.1.0",
    description=("Out-of-distribution detection with hierarchical Gaussian Dirichlet-process "
                 "mixture models (a Bayesian nonparametric view of the Mahalanobis score)."),
    packages=find_packages(include=["dpmm_jax", "dpmm_jax.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    install_requires=["jax", "jaxlib", "optax", "numpy", "chex", "matplotlib", "absl-py"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "scipy", "scikit-learn", "hypothesis",
                 "nbclient", "nbformat", "ipykernel"],
    },
)
