"""Float64 numpy reference for the coupled-diagonal model's predictive densities (no jax:
importable from the float32 and the float64 test processes alike).

The class predictive is p(x | D) = int p(u) p(D | u) p(x | u, D) du / int p(u) p(D | u) du
over u = log gamma with gamma ~ Gamma(alpha0, alpha0), summed on a 20,001-node grid.
"""
import numpy as np
import scipy.special

REF_NODES = 20_001


def log_evidence(x, loc0, var0, df0, kappa0, gamma):
  """(P,) log p(X | gamma) of one class under the NIX prior, straight from the textbook
  formula, summed over dimensions (x: (N, D); gamma: (P,))."""
  n = x.shape[0]
  xbar = x.mean(0)
  r = np.sum((x - xbar) ** 2, 0) + kappa0 * n / (kappa0 + n) * (xbar - loc0) ** 2
  kn, nun = kappa0 + n, df0 + n
  a = df0 * gamma[:, None] * var0
  per_dim = (scipy.special.gammaln(nun / 2) - scipy.special.gammaln(df0 / 2)
             + 0.5 * np.log(kappa0 / kn) + 0.5 * df0 * np.log(a) - 0.5 * nun * np.log(a + r)
             - 0.5 * n * np.log(np.pi))
  return per_dim.sum(-1)


def log_predictive(x_train, x_test, loc0, var0, df0, kappa0, alpha0, u_range=(-25.0, 15.0)):
  """log p(x | D) = log int p(u) p(D | u) p(x | u, D) du - log int p(u) p(D | u) du on
  20,001 nodes in u = log gamma over ``u_range`` (x_train may have no rows: the prior
  predictive)."""
  n = x_train.shape[0]
  u = np.linspace(*u_range, REF_NODES)
  gamma = np.exp(u)
  log_prior = alpha0 * np.log(alpha0) - scipy.special.gammaln(alpha0) + alpha0 * u - alpha0 * gamma
  if n:
    log_post = log_prior + log_evidence(x_train, loc0, var0, df0, kappa0, gamma)
    xbar = x_train.mean(0)
    sq = np.sum((x_train - xbar) ** 2, 0)
    r = sq + kappa0 * n / (kappa0 + n) * (xbar - loc0) ** 2
  else:
    log_post, xbar, r = log_prior, loc0, 0.0
  kn, nun = kappa0 + n, df0 + n
  mun = (kappa0 * loc0 + n * xbar) / kn
  scale_sq = (df0 * gamma[:, None] * var0 + r) / nun * (kn + 1) / kn          # (P, D)
  half = 0.5 * (nun + 1.0)
  norm = np.sum(scipy.special.gammaln(half) - scipy.special.gammaln(0.5 * nun)
                - 0.5 * np.log(nun * np.pi * scale_sq), -1)
  out = []
  for xt in x_test:
    lt = norm - np.sum(half * np.log1p((xt - mun) ** 2 / (nun * scale_sq)), -1)
    out.append(scipy.special.logsumexp(log_post + lt) - scipy.special.logsumexp(log_post))
  return np.array(out)
