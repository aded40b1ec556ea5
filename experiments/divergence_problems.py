"""Test densities for the co-BPM divergence estimator: products of beta mixtures.

The paper's densities (its Figures 4-6) are missing from the text; these stand in for them.
Each coordinate of P and Q is a mixture of beta densities on [0, 1]:

* ``bimodal`` = 0.5 Beta(2, 8) + 0.5 Beta(8, 2) (vanishes at both ends, like the paper's),
* ``flat``    = 0.5 Beta(1, 1) + 0.5 Beta(3, 3) (bounded below by 1/2, so KL(P || Q) and
  the alpha = 2 divergence sum P^2 / Q are finite),
* ``hump``    = Beta(2, 2).
* ``skewed``  = 0.7 Beta(2, 6) + 0.3 Beta(6, 3) (asymmetric: the first halving at 1/2
  already separates it from ``flat``).

Problems (P first, Q second):

* ``d1``: P = bimodal, Q = flat.
* ``d3``: P = bimodal x bimodal x hump, Q = flat x flat x hump (the third coordinate is
  the same in both: an estimator must not invent a difference there). P's bimodal
  coordinates are symmetric about 1/2, so a dyadic partition sees no difference until it
  has halved a coordinate twice: the hard case for co-BPM.
* ``d3_skew``: P = skewed x skewed x hump, Q = flat x flat x hump (the same shape of
  problem without that symmetry; used for the prior-penalty study).

The true divergences are Monte Carlo averages over draws of P of functions of the density
ratio ``w = q / p``: TV = E[max(0, 1 - w)], Hellinger = sqrt(1 - E[sqrt(w)]),
KL = E[-log w], alpha-divergence (Csiszar, order a) = (E[w^(1 - a)] - 1) / (a (a - 1)).
"""
import math
from typing import Dict, List, Sequence, Tuple

import numpy as np

# (weights, [(a, b), ...]) of each univariate mixture.
MIXTURES = {
    "bimodal": ((0.5, 0.5), ((2.0, 8.0), (8.0, 2.0))),
    "flat": ((0.5, 0.5), ((1.0, 1.0), (3.0, 3.0))),
    "hump": ((1.0,), ((2.0, 2.0),)),
    "skewed": ((0.7, 0.3), ((2.0, 6.0), (6.0, 3.0))),
}
PROBLEMS = {
    "d1": (("bimodal",), ("flat",)),
    "d3": (("bimodal", "bimodal", "hump"), ("flat", "flat", "hump")),
    "d3_skew": (("skewed", "skewed", "hump"), ("flat", "flat", "hump")),
}


def _log_beta_pdf(x, a, b):
  log_norm = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
  with np.errstate(divide="ignore"):
    return log_norm + (a - 1.0) * np.log(x) + (b - 1.0) * np.log1p(-x)


def log_density(components: Sequence[str], x) -> np.ndarray:
  """log of the product density at x (M, D)."""
  x = np.asarray(x, np.float64)
  out = np.zeros(x.shape[0])
  for k, name in enumerate(components):
    weights, params = MIXTURES[name]
    terms = [math.log(w) + _log_beta_pdf(x[:, k], a, b) for w, (a, b) in zip(weights, params)]
    out += np.logaddexp.reduce(np.stack(terms), axis=0)
  return out


def sample(components: Sequence[str], n: int, rng: np.random.Generator) -> np.ndarray:
  """(n, D) draws of the product density."""
  cols = []
  for name in components:
    weights, params = MIXTURES[name]
    which = rng.choice(len(weights), size=n, p=weights)
    a = np.array([p[0] for p in params])[which]
    b = np.array([p[1] for p in params])[which]
    cols.append(rng.beta(a, b))
  return np.stack(cols, axis=1)


def sample_pair(problem: str, n: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
  p, q = PROBLEMS[problem]
  return sample(p, n, rng), sample(q, n, rng)


def monte_carlo_truth(problem: str, num_draws: int, rng: np.random.Generator,
                      alpha: float = 2.0, chunk: int = 1_000_000) -> Dict[str, float]:
  """True tv, hellinger, kl, alpha divergences of P from Q by Monte Carlo (with std errors)."""
  p, q = PROBLEMS[problem]
  sums = np.zeros(4)
  sq = np.zeros(4)
  done = 0
  while done < num_draws:
    m = min(chunk, num_draws - done)
    x = sample(p, m, rng)
    log_w = log_density(q, x) - log_density(p, x)
    w = np.exp(log_w)
    vals = np.stack([np.maximum(0.0, 1.0 - w), np.sqrt(w), -log_w,
                     np.exp((1.0 - alpha) * log_w)])
    sums += vals.sum(axis=1)
    sq += (vals ** 2).sum(axis=1)
    done += m
  mean = sums / done
  se = np.sqrt(np.maximum(sq / done - mean ** 2, 0.0) / done)
  return {
      "tv": float(mean[0]), "tv_se": float(se[0]),
      "hellinger": float(math.sqrt(max(1.0 - mean[1], 0.0))),
      "hellinger_se": float(se[1] / (2 * math.sqrt(max(1.0 - mean[1], 1e-12)))),
      "kl": float(mean[2]), "kl_se": float(se[2]),
      "alpha": float((mean[3] - 1.0) / (alpha * (alpha - 1.0))),
      "alpha_se": float(se[3] / abs(alpha * (alpha - 1.0))),
  }


def pad_pairs(pairs: List[Tuple[np.ndarray, np.ndarray]]):
  """Stacks pairs of samples of different sizes: (B, N1max, D), (B, N2max, D) + masks."""
  n1 = max(x.shape[0] for x, _ in pairs)
  n2 = max(y.shape[0] for _, y in pairs)
  dim = pairs[0][0].shape[1]
  xs = np.zeros((len(pairs), n1, dim), np.float32)
  ys = np.zeros((len(pairs), n2, dim), np.float32)
  vx = np.zeros((len(pairs), n1), bool)
  vy = np.zeros((len(pairs), n2), bool)
  for b, (x, y) in enumerate(pairs):
    xs[b, :x.shape[0]] = x
    ys[b, :y.shape[0]] = y
    vx[b, :x.shape[0]] = True
    vy[b, :y.shape[0]] = True
  return xs, ys, vx, vy
