"""MCMC diagnostics: multi-chain effective sample size.

ESS = C S / (1 + 2 sum_t rho_t), with the autocorrelations rho_t combined over chains as
in Gelman et al. (BDA3, section 11.5): rho_t = 1 - (W - mean_c acov_c(t)) / var_plus,
var_plus = (S - 1)/S W + B/S, and the sum truncated by Geyer's initial monotone sequence
(pairs rho_{2t} + rho_{2t+1} kept while positive, made non-increasing). Host-side numpy:
a diagnostic on stored draws, not a jitted kernel.
"""
import numpy as np


def _autocovariance(x):
  """(C, S, ...) -> (C, S, ...) biased autocovariance along axis 1 by FFT."""
  s = x.shape[1]
  centred = x - x.mean(axis=1, keepdims=True)
  n = 1 << (2 * s - 1).bit_length()
  f = np.fft.rfft(centred, n=n, axis=1)
  acov = np.fft.irfft(f * np.conj(f), n=n, axis=1)[:, :s]
  return acov / s


def effective_sample_size(draws):
  """Effective sample size of every component of (C chains, S draws, ...) draws.

  Args:
    draws: array (C, S, ...) with S >= 4.
  Returns:
    (...) ESS (at most C S up to the antithetic case, where it can exceed it).
  Raises:
    ValueError: fewer than 4 draws per chain or non-finite draws.
  """
  x = np.asarray(draws, np.float64)
  if x.ndim < 2 or x.shape[1] < 4:
    raise ValueError(f"draws must be (chains, draws >= 4, ...), got shape {x.shape}.")
  if not np.all(np.isfinite(x)):
    raise ValueError("draws contain non-finite values.")
  c, s = x.shape[:2]
  acov = _autocovariance(x)                                   # (C, S, ...)
  chain_mean = x.mean(axis=1)
  w = acov[:, 0].mean(axis=0) * s / (s - 1.0)                 # within-chain variance
  b = s * chain_mean.var(axis=0, ddof=1) if c > 1 else np.zeros_like(w)
  var_plus = (s - 1.0) / s * w + b / s
  var_plus = np.where(var_plus > 0, var_plus, np.inf)
  rho = 1.0 - (w - acov.mean(axis=0)) / var_plus              # (S, ...)
  rho[0] = 1.0
  num_pairs = s // 2
  pairs = rho[:2 * num_pairs].reshape((num_pairs, 2) + rho.shape[1:]).sum(axis=1)
  positive = np.cumprod(pairs > 0, axis=0).astype(bool)       # initial positive sequence
  pairs = np.where(positive, pairs, 0.0)
  pairs = np.minimum.accumulate(pairs, axis=0)                # initial monotone sequence
  tau = -1.0 + 2.0 * pairs.sum(axis=0)
  return c * s / np.maximum(tau, 1.0 / np.log10(c * s + 10.0))
