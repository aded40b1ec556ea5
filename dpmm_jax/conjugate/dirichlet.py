"""Dirichlet and Beta distributions, and truncated stick-breaking weights.

Mean-field building blocks (same verbs as ``niw``/``nix``/``gamma``). A Beta(a, b) is the
Dirichlet with concentration (a, b) on the last axis. Stick-breaking with truncation T:
v_l ~ Beta(a_l, b_l) for l < T, v_T = 1, omega_l = v_l prod_{j<l} (1 - v_j).
"""
import jax.numpy as jnp
from jax.scipy import special as jsp


def mean(concentration):
  """(..., K) E[pi] = alpha / sum(alpha)."""
  return concentration / jnp.sum(concentration, -1, keepdims=True)


def expected_log(concentration):
  """(..., K) E[log pi_k] = psi(alpha_k) - psi(sum alpha)."""
  return jsp.digamma(concentration) - jsp.digamma(jnp.sum(concentration, -1, keepdims=True))


def log_normalizer(concentration):
  """(...,) log B(alpha) = sum log Gamma(alpha_k) - log Gamma(sum alpha)."""
  return (jnp.sum(jsp.gammaln(concentration), -1)
          - jsp.gammaln(jnp.sum(concentration, -1)))


def log_density(pi, concentration):
  """(...,) log Dir(pi | alpha) for pi on the simplex (last axis)."""
  return jnp.sum((concentration - 1.0) * jnp.log(pi), -1) - log_normalizer(concentration)


def kl_divergence(q, p):
  """(...,) KL(Dir(q) || Dir(p)) = log B(p) - log B(q) + sum (q - p) E_q[log pi]."""
  p = jnp.broadcast_to(p, q.shape)
  return log_normalizer(p) - log_normalizer(q) + jnp.sum((q - p) * expected_log(q), -1)


def beta_kl_divergence(a_q, b_q, a_p, b_p):
  """Elementwise KL(Beta(a_q, b_q) || Beta(a_p, b_p))."""
  a_p, b_p = jnp.broadcast_to(a_p, a_q.shape), jnp.broadcast_to(b_p, a_q.shape)
  return kl_divergence(jnp.stack([a_q, b_q], -1), jnp.stack([a_p, b_p], -1))


def stick_breaking_expected_log_weights(a, b):
  """(..., T) E[log omega_l] for truncated stick-breaking with q(v_l) = Beta(a_l, b_l).

  E log omega_l = E log v_l + sum_{j<l} E log(1 - v_j), with v_T = 1 (so the last weight
  takes the remaining stick).

  Args:
    a, b: (..., T - 1) Beta parameters of the first T - 1 sticks.
  Returns:
    (..., T) expected log weights.
  """
  total = jsp.digamma(a + b)
  log_v = jsp.digamma(a) - total
  log_1mv = jsp.digamma(b) - total
  zero = jnp.zeros(a.shape[:-1] + (1,), a.dtype)
  log_v = jnp.concatenate([log_v, zero], -1)
  rest = jnp.concatenate([zero, jnp.cumsum(log_1mv, -1)], -1)
  return log_v + rest
