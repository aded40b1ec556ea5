"""dpmm_jax: out-of-distribution detection with hierarchical Gaussian DPMMs in JAX.

One-call API::

    det = dpmm_jax.fit_detector(X, y, model="coupled")
    s = dpmm_jax.score(det, X_test)                 # higher = more in-distribution
    p = dpmm_jax.outlier_probability(det, X_test, alpha=1.0)
    yhat = dpmm_jax.predict(det, X_test)
    dpmm_jax.save(det, "detector.npz"); det = dpmm_jax.load("detector.npz")
    dets = dpmm_jax.fit_detectors(X, y, ["tied", "full", "diag", "coupled", "rmds"])

The functional layer (``stats``, ``preprocess``, ``conjugate.niw``/``nix``, ``newton``,
``em``, ``models.*``, ``scores``, ``metrics``) stays public for composing in JAX code.
"""
from dpmm_jax.api import (DPMM_MODELS, MODEL_OPTIONS, MODELS, ConvergenceWarning, Detector,
                          FewShotWarning, FitReport, FitDiagnosticWarning,
                          IdenticalClassWarning,
                          class_scores, fit_detector, fit_detector_with_info,
                          fit_detectors, fit_detectors_with_info,
                          outlier_probability, predict, score)
from dpmm_jax.discovery import Discovery, discover
from dpmm_jax.serialization import DetectorFileError, load, save
from dpmm_jax import compilation_cache, threads  # per-user compile cache; BLAS threads
from dpmm_jax import functional  # pure, jittable scoring of a fitted Detector

__version__ = "0.1.0"
