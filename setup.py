"""Install dpmm_jax: hierarchical Gaussian DPMMs for out-of-distribution detection in JAX."""
from setuptools import find_packages, setup

setup(
    name="dpmm_jax",
    version="0.1.0",
    description=("Out-of-distribution detection with hierarchical Gaussian Dirichlet-process "
                 "mixture models (a Bayesian nonparametric view of the Mahalanobis score)."),
    packages=find_packages(include=["dpmm_jax", "dpmm_jax.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    # jax/jaxlib 0.10.x run batched CPU LAPACK kernels (Cholesky, triangular solves,
    # eigh) on XLA's intra-op pool and block pool threads on their sub-tasks: two such
    # kernels running at once on a 2-core machine deadlock (seen in the full-covariance
    # model at D >= 256). 0.9.2 and releases that build this path out are fine.
    install_requires=["jax>=0.9.2,!=0.10.*", "jaxlib>=0.9.2,!=0.10.*", "optax", "numpy",
                      "chex", "matplotlib", "absl-py", "threadpoolctl"],
    extras_require={
        "test": ["pytest", "pytest-xdist", "scipy", "scikit-learn", "hypothesis",
                 "nbclient", "nbformat", "ipykernel"],
    },
)
