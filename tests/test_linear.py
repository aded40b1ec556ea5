"""Tests for dpmm_jax.models.linear (linear softmax head, MSP scores). float32 only."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp
from scipy.stats import spearmanr

from dpmm_jax.models import linear

NUM_CLASSES = 3


def _blobs(seed, n_per_class=100, dim=4, num_classes=NUM_CLASSES, sep=8.0, noise_seed=None):
    """Well-separated isotropic Gaussian blobs (linearly separable w.h.p.).

    ``seed`` fixes the class centres; ``noise_seed`` (default: ``seed``) the
    points, so a held-out set shares the centres but not the noise.
    """
    centers = np.random.default_rng(seed).normal(size=(num_classes, dim))
    rng = np.random.default_rng([seed, seed if noise_seed is None else noise_seed])
    centers = sep * centers / np.linalg.norm(centers, axis=1, keepdims=True)
    y = np.repeat(np.arange(num_classes), n_per_class)
    x = centers[y] + rng.normal(size=(y.size, dim))
    perm = rng.permutation(y.size)
    return x[perm].astype(np.float32), y[perm].astype(np.int32)


def _ref_log_msp64(z, temperature):
    """float64 numpy reference: max_k z_k / T - logsumexp(z / T)."""
    z64 = np.asarray(z, np.float64) / temperature
    return z64.max(axis=-1) - logsumexp(z64, axis=-1)


@pytest.fixture(scope="module")
def data():
    return _blobs(0)


@pytest.fixture(scope="module")
def full_batch_fit(data):
    x, y = data
    return linear.fit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(0))


# ----------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------

def test_fit_shapes_and_loss_decreases(data, full_batch_fit):
    x, _ = data
    params, info = full_batch_fit
    assert params.weights.shape == (x.shape[1], NUM_CLASSES)
    assert params.bias.shape == (NUM_CLASSES,)
    assert params.weights.dtype == jnp.float32
    assert info.loss_trace.shape == (500,)
    trace = np.asarray(info.loss_trace)
    assert np.all(np.isfinite(trace))
    # zero init => first loss is exactly log K
    np.testing.assert_allclose(trace[0], np.log(NUM_CLASSES), rtol=1e-5)
    assert trace[-1] < 0.1 * trace[0]
    assert float(info.final_loss) <= trace[-1] + 1e-6
    # full-batch Adam on a convex problem: essentially monotone
    assert np.mean(np.diff(trace) <= 1e-6) > 0.95


def test_fit_separable_accuracy(data, full_batch_fit):
    x, y = data
    params, info = full_batch_fit
    assert float(info.train_accuracy) > 0.95
    acc = float(np.mean(np.asarray(linear.predict(params, x)) == y))
    np.testing.assert_allclose(acc, float(info.train_accuracy), atol=1e-6)
    x_test, y_test = _blobs(0, n_per_class=50, noise_seed=99)  # held-out points
    assert np.mean(np.asarray(linear.predict(params, x_test)) == y_test) > 0.95


def test_matches_sklearn_logistic_regression(data, full_batch_fit):
    from sklearn.linear_model import LogisticRegression

    x, y = data
    params, _ = full_batch_fit
    # lbfgs on a multiclass problem is the multinomial model; large C ~ no penalty.
    clf = LogisticRegression(C=1e4, max_iter=2000).fit(x, y)
    rng = np.random.default_rng(1)
    x_eval = np.concatenate([x, x + 0.5 * rng.normal(size=x.shape).astype(np.float32)])
    ours = np.asarray(linear.predict(params, x_eval))
    theirs = clf.predict(x_eval)
    assert np.mean(ours == theirs) >= 0.95


def test_minibatch_fit_and_determinism(data):
    x, y = data
    kw = dict(num_steps=300, learning_rate=2e-2, batch_size=32)
    p1, i1 = linear.fit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(3), **kw)
    p2, i2 = linear.fit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(3), **kw)
    p3, i3 = linear.fit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(4), **kw)
    # same key => bit-identical
    np.testing.assert_array_equal(p1.weights, p2.weights)
    np.testing.assert_array_equal(p1.bias, p2.bias)
    np.testing.assert_array_equal(i1.loss_trace, i2.loss_trace)
    # different key => different minibatches
    assert not np.array_equal(np.asarray(i1.loss_trace), np.asarray(i3.loss_trace))
    for info in (i1, i3):
        assert info.loss_trace.shape == (300,)
        tr = np.asarray(info.loss_trace)
        assert tr[-20:].mean() < 0.2 * tr[0]
        assert float(info.train_accuracy) > 0.95


def test_full_batch_deterministic_and_key_independent(data, full_batch_fit):
    x, y = data
    params, info = full_batch_fit
    p2, i2 = linear.fit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(123))
    np.testing.assert_array_equal(params.weights, p2.weights)
    np.testing.assert_array_equal(info.loss_trace, i2.loss_trace)


def test_fit_is_jittable(data, full_batch_fit):
    x, y = data
    jfit = jax.jit(linear.fit, static_argnames=("num_classes", "num_steps", "batch_size"))
    params, info = jfit(jnp.asarray(x), jnp.asarray(y), NUM_CLASSES,
                        key=jax.random.PRNGKey(0), num_steps=500)
    ref_params, ref_info = full_batch_fit
    np.testing.assert_allclose(params.weights, ref_params.weights, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(info.final_loss, ref_info.final_loss, rtol=1e-4, atol=1e-6)
    # minibatch path under jit, with traced hyperparameters
    _, info_mb = jfit(x, y, NUM_CLASSES, key=jax.random.PRNGKey(1), num_steps=50,
                      batch_size=16, learning_rate=jnp.float32(0.05),
                      weight_decay=jnp.float32(0.0))
    assert info_mb.loss_trace.shape == (50,)
    assert np.all(np.isfinite(np.asarray(info_mb.loss_trace)))


def test_fit_accepts_integer_features():
    x = np.array([[0, 0], [0, 1], [5, 5], [5, 6]])
    y = np.array([0, 0, 1, 1])
    params, info = linear.fit(x, y, 2, key=jax.random.PRNGKey(0), num_steps=100,
                              learning_rate=0.1)
    assert jnp.issubdtype(params.weights.dtype, jnp.floating)
    assert float(info.train_accuracy) == 1.0


_X = np.zeros((6, 2), np.float32)
_Y = np.array([0, 1, 2, 0, 1, 2], np.int32)


@pytest.mark.parametrize(
    "x, y, kwargs, match",
    [
        (np.zeros(6, np.float32), _Y, {}, "x must be 2-D"),
        (np.zeros((6, 2, 1), np.float32), _Y, {}, "x must be 2-D"),
        (_X, _Y[:, None], {}, "y must be 1-D"),
        (_X, _Y[:5], {}, "disagree on the number of points"),
        (_X, np.array([0, 1, 3, 0, 1, 2]), {}, r"labels must lie in \[0, num_classes=3\)"),
        (_X, np.array([0, -1, 2, 0, 1, 2]), {}, "labels must lie in"),
        (_X, _Y.astype(np.float32), {}, "integer class labels"),
        (np.full((6, 2), np.nan, np.float32), _Y, {}, "non-finite"),
        (_X, _Y, {"num_classes": 1}, "num_classes must be >= 2"),
        (_X, _Y, {"num_steps": 0}, "num_steps must be >= 1"),
        (_X, _Y, {"num_steps": 10.0}, "num_steps must be a Python int"),
        (_X, _Y, {"batch_size": 0}, "batch_size must be >= 1"),
        (_X, _Y, {"learning_rate": 0.0}, "learning_rate must be > 0"),
        (_X, _Y, {"weight_decay": -1.0}, "weight_decay must be >= 0"),
    ],
)
def test_fit_rejects_bad_input(x, y, kwargs, match):
    kwargs = dict(kwargs)
    num_classes = kwargs.pop("num_classes", 3)
    with pytest.raises(ValueError, match=match):
        linear.fit(x, y, num_classes, key=jax.random.PRNGKey(0), **kwargs)


def test_fit_rejects_bad_input_under_jit():
    jfit = jax.jit(linear.fit, static_argnames=("num_classes", "num_steps", "batch_size"))
    with pytest.raises(ValueError, match="x must be 2-D"):
        jfit(jnp.zeros(6), jnp.asarray(_Y), 3, key=jax.random.PRNGKey(0))


# ----------------------------------------------------------------------------
# inference and MSP scores
# ----------------------------------------------------------------------------

def _identity_head(k):
    """Head whose logits equal its input (lets us feed chosen logits)."""
    return linear.LinearHeadParams(weights=jnp.eye(k, dtype=jnp.float32),
                                   bias=jnp.zeros((k,), jnp.float32))


def test_logits_and_predict(data, full_batch_fit):
    x, _ = data
    params, _ = full_batch_fit
    z = linear.logits(params, x)
    assert z.shape == (x.shape[0], NUM_CLASSES)
    np.testing.assert_allclose(z, x @ np.asarray(params.weights) + np.asarray(params.bias),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(linear.predict(params, x), np.argmax(np.asarray(z), -1))
    with pytest.raises(ValueError, match="must have shape"):
        linear.logits(params, np.zeros((3, x.shape[1] + 1), np.float32))


def test_msp_is_exp_of_log_msp_and_matches_softmax(data, full_batch_fit):
    x, _ = data
    params, _ = full_batch_fit
    z = np.asarray(linear.logits(params, x))
    for t in (1.0, 2.0, 1000.0):
        log_s = np.asarray(linear.log_msp_score(params, x, temperature=t))
        s = np.asarray(linear.msp_score(params, x, temperature=t))
        assert log_s.shape == s.shape == (x.shape[0],)
        np.testing.assert_allclose(s, np.exp(log_s), rtol=1e-6)
        np.testing.assert_allclose(log_s, _ref_log_msp64(z, t), rtol=1e-5, atol=1e-6)
        assert np.all(log_s <= 0) and np.all(log_s >= -np.log(NUM_CLASSES) - 1e-6)
    # T = 1000: all probabilities ~ 1/K
    s1000 = np.asarray(linear.msp_score(params, x, temperature=1000.0))
    np.testing.assert_allclose(s1000, 1.0 / NUM_CLASSES, rtol=0.1)
    np.testing.assert_allclose(
        np.asarray(linear.msp_score(params, x)),
        np.asarray(jax.nn.softmax(jnp.asarray(z), axis=-1).max(-1)), rtol=1e-5, atol=1e-6)


def test_log_msp_t1000_ranks_like_float64_on_random_logits():
    rng = np.random.default_rng(0)
    k = 10
    z = (3.0 * rng.normal(size=(2000, k))).astype(np.float32)
    ref = _ref_log_msp64(z, 1000.0)
    via_logits = np.asarray(linear.log_max_softmax(z, 1000.0))
    via_head = np.asarray(linear.log_msp_score(_identity_head(k), z, temperature=1000.0))
    for got in (via_logits, via_head):
        assert got.dtype == np.float32
        assert np.all(np.isfinite(got))
        assert spearmanr(got, ref)[0] >= 0.999
        np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("temperature, gap_scale", [(1000.0, 1000.0), (1.0, 1.0)])
def test_log_msp_does_not_collapse_where_naive_float32_does(temperature, gap_scale):
    """Confident points: float32 p_max rounds to exactly 1, the log score doesn't.

    Top-1 margins (in units of T) are spread over [5, 25], so 1 - p_max ranges
    from ~7e-3 down to ~1e-11; float32 cannot represent 1 - p_max < 2**-25 ~ 3e-8
    (margin > ~17), so the naive exp-based MSP ties all those points at 1.0.
    At T = 1000 this needs logits of order 1e4; at T = 1 ordinary confident logits.
    """
    rng = np.random.default_rng(1)
    m, k = 500, 10
    margins = rng.uniform(5.0, 25.0, size=m)
    z = rng.normal(scale=0.5, size=(m, k))
    z[:, 0] = z[:, 1:].max(axis=1) + margins
    z = (gap_scale * z).astype(np.float32)
    zj = jnp.asarray(z)

    naive_softmax = np.asarray(jax.nn.softmax(zj / temperature, axis=-1).max(-1))
    naive_exp = np.asarray(jnp.exp(jnp.max(zj / temperature, -1)
                                   - jax.nn.logsumexp(zj / temperature, -1)))
    log_s = np.asarray(linear.log_msp_score(_identity_head(k), z, temperature=temperature))
    ref = _ref_log_msp64(z, temperature)

    for naive in (naive_softmax, naive_exp):
        assert np.mean(naive == 1.0) > 0.25          # many exact ties at 1.0
        assert len(np.unique(naive)) < 0.8 * m
        assert spearmanr(naive, ref)[0] < 0.99
    assert np.all(np.isfinite(log_s)) and np.all(log_s < 0)
    assert len(np.unique(log_s)) == m                # no ties
    assert spearmanr(log_s, ref)[0] >= 0.999
    # and msp_score (= exp of the log score) does collapse, hence use the log one
    assert np.mean(np.asarray(linear.msp_score(_identity_head(k), z, temperature)) == 1.0) > 0.25


def test_log_max_softmax_edge_cases():
    k = 4
    # all-equal logits => exactly log(1/K)
    out = np.asarray(linear.log_max_softmax(np.zeros((3, k), np.float32), 1000.0))
    np.testing.assert_allclose(out, -np.log(k), rtol=1e-6)
    # large common offset costs nothing
    z = np.array([[1e6, 1e6 + 3.0, 1e6 - 2.0, 1e6]], np.float32)
    np.testing.assert_allclose(linear.log_max_softmax(z, 1.0),
                               _ref_log_msp64(z - 1e6, 1.0), rtol=1e-5)
    # single-point and batched leading dims
    assert linear.log_max_softmax(np.zeros(k, np.float32)).shape == ()
    assert linear.log_max_softmax(np.zeros((2, 3, k), np.float32)).shape == (2, 3)
    for bad_t in (0.0, -1.0, np.inf):
        with pytest.raises(ValueError, match="temperature"):
            linear.log_max_softmax(np.zeros((2, k), np.float32), bad_t)


@settings(max_examples=25, deadline=None)
@given(
    logits=st.lists(st.floats(-50.0, 50.0, width=32), min_size=2, max_size=6),
    temperature=st.sampled_from([0.5, 1.0, 10.0, 1000.0]),
)
def test_log_max_softmax_property(logits, temperature):
    z = np.asarray(logits, np.float32)[None, :]
    got = float(linear.log_max_softmax(z, temperature)[0])
    ref = float(_ref_log_msp64(z, temperature)[0])
    assert -np.log(z.shape[1]) - 1e-5 <= got <= 0.0
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
