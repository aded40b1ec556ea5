"""Tests for dpmm_jax.metrics, checked against scikit-learn and hand-computed cases."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from sklearn import metrics as skm

from dpmm_jax import metrics

# Every comparison with scikit-learn below is between two exact float64 computations
# of the same rational number (counts divided by counts), differing only in the order
# of float additions, so an absolute tolerance of 1e-12 (~10^4 ulps at 1) is ample and
# would still catch any off-by-one count (which moves a metric by >= 1 / (M M_ood)).
EXACT = 1e-12


def _labels(s_in, s_out):
    return np.concatenate([np.ones(len(s_in)), np.zeros(len(s_out))])


def _sk_auroc(s_in, s_out):
    return skm.roc_auc_score(_labels(s_in, s_out), np.concatenate([s_in, s_out]))


def _sk_fpr_at_tpr(s_in, s_out, tpr, positive="ood", drop_intermediate=False):
    """FPR at TPR read directly off sklearn's ROC curve, per convention.

    "ood": OOD is the positive class and is ranked by the negated score (OpenOOD
    v1.5's ``roc_curve(ood_indicator, -conf)``); "in": ID positive, ranked by the score.
    """
    is_in = _labels(s_in, s_out)
    scores = np.concatenate([s_in, s_out])
    if positive == "ood":
        y, s = 1 - is_in, -scores
    else:
        y, s = is_in, scores
    fpr, tpr_curve, _ = skm.roc_curve(y, s, drop_intermediate=drop_intermediate)
    return fpr[np.argmax(tpr_curve >= tpr)]


def _sk_aupr_in(s_in, s_out):
    return skm.average_precision_score(_labels(s_in, s_out),
                                       np.concatenate([s_in, s_out]))


def _sk_aupr_out(s_in, s_out):
    return skm.average_precision_score(1 - _labels(s_in, s_out),
                                       -np.concatenate([s_in, s_out]))


def _random_cases():
    """Continuous, heavily tied (integer) and separable score sets of varied sizes."""
    rng = np.random.default_rng(0)
    cases = []
    for m_in, m_out in [(1, 1), (1, 7), (5, 1), (37, 53), (200, 150), (1000, 3000)]:
        cases.append((rng.normal(1.0, 1.0, m_in), rng.normal(0.0, 1.5, m_out)))
        # Heavy ties: a handful of integer values shared by both sets.
        cases.append((rng.integers(0, 4, m_in).astype(float),
                      rng.integers(-1, 3, m_out).astype(float)))
        cases.append((rng.integers(0, 2, m_in).astype(float),
                      rng.integers(0, 2, m_out).astype(float)))
    cases.append((np.full(10, 3.0), np.full(20, 3.0)))  # all tied
    cases.append((np.arange(10.0) + 100, np.arange(10.0)))  # separable
    cases.append((np.arange(10.0), np.arange(10.0) + 100))  # reversed
    return cases


CASES = _random_cases()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_against_sklearn(case):
    s_in, s_out = CASES[case]
    assert metrics.auroc(s_in, s_out) == pytest.approx(_sk_auroc(s_in, s_out), abs=EXACT)
    assert metrics.aupr_in(s_in, s_out) == pytest.approx(_sk_aupr_in(s_in, s_out),
                                                         abs=EXACT)
    assert metrics.aupr_out(s_in, s_out) == pytest.approx(_sk_aupr_out(s_in, s_out),
                                                          abs=EXACT)
    for tpr in [0.05, 0.5, 0.8, 0.95, 1.0]:
        for positive in ("ood", "in"):
            got = metrics.fpr_at_tpr(s_in, s_out, tpr, positive=positive)
            for drop in (False, True):
                assert got == pytest.approx(
                    _sk_fpr_at_tpr(s_in, s_out, tpr, positive, drop), abs=EXACT)
    # The default is the OpenOOD convention.
    assert metrics.fpr_at_tpr(s_in, s_out) == metrics.fpr_at_tpr(s_in, s_out,
                                                                 positive="ood")


def _brute_auroc(s_in, s_out):
    diff = np.asarray(s_in)[:, None] - np.asarray(s_out)[None, :]
    return float(np.mean((diff > 0) + 0.5 * (diff == 0)))


def _brute_fpr_at_tpr(s_in, s_out, tpr, positive):
    """Scans every candidate threshold (definition check).

    "in": accept as ID when score >= t, t from the highest down, stop at the first
    t catching >= tpr of the ID points; report the share of OOD points accepted.
    "ood": flag as OOD when score <= u, u from the lowest up, stop at the first u
    catching >= tpr of the OOD points; report the share of ID points flagged.
    """
    s_in, s_out = np.asarray(s_in), np.asarray(s_out)
    candidates = np.unique(np.concatenate([s_in, s_out]))
    if positive == "in":
        for t in candidates[::-1]:
            if np.mean(s_in >= t) >= tpr:
                return float(np.mean(s_out >= t))
    else:
        for u in candidates:
            if np.mean(s_out <= u) >= tpr:
                return float(np.mean(s_in <= u))
    raise AssertionError("unreachable for tpr <= 1")


finite_scores = hnp.arrays(
    np.float64, st.integers(1, 40),
    elements=st.one_of(st.integers(-3, 3).map(float),
                       st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)))


@settings(max_examples=60, deadline=None)
@given(s_in=finite_scores, s_out=finite_scores,
       tpr=st.floats(0.01, 1.0, allow_nan=False))
def test_property_brute_force_and_sklearn(s_in, s_out, tpr):
    assert metrics.auroc(s_in, s_out) == pytest.approx(_brute_auroc(s_in, s_out),
                                                       abs=EXACT)
    assert metrics.auroc(s_in, s_out) == pytest.approx(_sk_auroc(s_in, s_out), abs=EXACT)
    for positive in ("ood", "in"):
        got = metrics.fpr_at_tpr(s_in, s_out, tpr, positive=positive)
        assert got == pytest.approx(_brute_fpr_at_tpr(s_in, s_out, tpr, positive),
                                    abs=EXACT)
        assert got == pytest.approx(_sk_fpr_at_tpr(s_in, s_out, tpr, positive),
                                    abs=EXACT)
    assert metrics.aupr_in(s_in, s_out) == pytest.approx(_sk_aupr_in(s_in, s_out),
                                                         abs=EXACT)
    assert metrics.aupr_out(s_in, s_out) == pytest.approx(_sk_aupr_out(s_in, s_out),
                                                          abs=EXACT)


@settings(max_examples=40, deadline=None)
@given(s_in=finite_scores, s_out=finite_scores,
       shift=st.floats(-100, 100, allow_nan=False),
       log_scale=st.floats(-3, 3, allow_nan=False))
def test_property_invariances(s_in, s_out, shift, log_scale):
    # Integer-valued scores keep ties exact under an affine map by a power of two.
    s_in, s_out = np.round(s_in), np.round(s_out)
    scale = 2.0 ** round(log_scale)
    t_in, t_out = s_in * scale + round(shift), s_out * scale + round(shift)
    assert metrics.auroc(t_in, t_out) == metrics.auroc(s_in, s_out)
    for positive in ("ood", "in"):
        assert (metrics.fpr_at_tpr(t_in, t_out, positive=positive)
                == metrics.fpr_at_tpr(s_in, s_out, positive=positive))
    # The OOD-positive FPR is the ID-positive one with the sets exchanged and negated.
    assert metrics.fpr_at_tpr(s_in, s_out, 0.9, positive="ood") == metrics.fpr_at_tpr(
        -s_out, -s_in, 0.9, positive="in")
    assert metrics.aupr_in(t_in, t_out) == pytest.approx(metrics.aupr_in(s_in, s_out),
                                                         abs=EXACT)
    # Swapping the roles of ID and OOD and negating the scores gives 1 - AUROC,
    # and exchanges AUPR-in with AUPR-out.
    assert metrics.auroc(-s_out, -s_in) == pytest.approx(metrics.auroc(s_in, s_out),
                                                         abs=EXACT)
    assert metrics.auroc(s_out, s_in) == pytest.approx(1 - metrics.auroc(s_in, s_out),
                                                       abs=EXACT)
    assert metrics.aupr_out(s_in, s_out) == pytest.approx(
        metrics.aupr_in(-s_out, -s_in), abs=EXACT)
    # Ranges.
    for value in metrics.ood_metrics(s_in, s_out).values():
        assert 0.0 <= value <= 1.0


def test_hand_cases():
    # Perfect separation.
    assert metrics.auroc([3, 4], [1, 2]) == 1.0
    assert metrics.fpr_at_tpr([3, 4], [1, 2], positive="in") == 0.0
    assert metrics.aupr_in([3, 4], [1, 2]) == 1.0
    assert metrics.aupr_out([3, 4], [1, 2]) == 1.0
    # Perfectly wrong.
    assert metrics.auroc([1, 2], [3, 4]) == 0.0
    assert metrics.fpr_at_tpr([1, 2], [3, 4], positive="in") == 1.0
    # All tied: AUROC 1/2; at the only threshold everything is called ID.
    assert metrics.auroc([0, 0], [0, 0, 0]) == 0.5
    assert metrics.fpr_at_tpr([0, 0], [0, 0, 0], positive="in") == 1.0
    assert metrics.aupr_in([0, 0], [0, 0, 0]) == pytest.approx(2 / 5)
    assert metrics.aupr_out([0, 0], [0, 0, 0]) == pytest.approx(3 / 5)
    # in = [1, 3], out = [2]: pairs (1<2), (3>2) -> AUROC 1/2.
    assert metrics.auroc([1, 3], [2]) == 0.5
    # Ranking 3(in), 2(out), 1(in): precisions at the ID hits 1 and 2/3.
    assert metrics.aupr_in([1, 3], [2]) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)
    # OOD positive, ranked by negated score: -1 (ID), -2 (OOD), -3 (ID); the single
    # OOD hit comes second, so its precision (and the AP) is 1/2.
    assert metrics.aupr_out([1, 3], [2]) == pytest.approx(0.5)
    # One tie with the threshold counts as a false positive (conservative).
    s_in = np.arange(1.0, 21.0)  # 20 ID points; 95% recall needs the 19 largest.
    fpr_in = lambda a, b, **kw: metrics.fpr_at_tpr(a, b, positive="in", **kw)
    assert fpr_in(s_in, [2.0, 1.5, 0.0, 0.0]) == 0.25  # 2.0 is tied.
    assert fpr_in(s_in, [1.9, 1.5, 0.0, 0.0]) == 0.0
    assert fpr_in(s_in, [2.0, 1.5, 0.0, 0.0], tpr=1.0) == 0.5
    # Ties inside ID push recall past the target in one step: threshold is 5,
    # TPR(5) = 1 >= 0.5; the OOD point at 5 is a false positive.
    assert fpr_in([5, 5, 5, 5], [5, 4], tpr=0.5) == 0.5
    # OOD positive (default). 20 OOD points at 1..20 (lower = more OOD): catching 95 %
    # of them needs u = 19; the ID points at <= 19 are flagged.
    s_out = np.arange(1.0, 21.0)
    assert metrics.fpr_at_tpr([19.0, 19.5, 30.0, 40.0], s_out) == 0.25  # 19 is tied.
    assert metrics.fpr_at_tpr([19.5, 25.0, 30.0, 40.0], s_out) == 0.0
    assert metrics.fpr_at_tpr([19.5, 25.0, 30.0, 40.0], s_out, tpr=1.0) == 0.25
    # The two conventions differ on the same scores: 10 ID points at 1..10, 10 OOD
    # points at 0.5..9.5. ID positive: accept >= 1 (95 % of ID needs all 10), which
    # accepts 9 of 10 OOD points. OOD positive: flag <= 9.5 (all 10 OOD), which flags
    # 9 of 10 ID points.
    a, b = np.arange(1.0, 11.0), np.arange(0.5, 10.0)
    assert fpr_in(a, b) == 0.9 and metrics.fpr_at_tpr(a, b) == 0.9
    # Asymmetric: ID tight and high, OOD spread: the conventions disagree.
    a, b = np.array([9.0, 10.0, 11.0, 12.0]), np.array([0.0, 1.0, 2.0, 10.5])
    # ID positive: accept >= 9 -> OOD 10.5 accepted: 1/4. OOD positive: flag <= 10.5
    # to catch all 4 OOD points (95 % of 4 needs 4) -> ID 9, 10 flagged: 2/4.
    assert fpr_in(a, b) == 0.25 and metrics.fpr_at_tpr(a, b) == 0.5
    # Accuracy.
    assert metrics.accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 0.75
    assert metrics.accuracy(jnp.array([1, 1]), np.array([1, 1])) == 1.0


def test_auroc_large_ties_exact():
    # 3 * 10^5 x 3 * 10^5 pairs; the exact Mann-Whitney value from counts.
    rng = np.random.default_rng(1)
    s_in = rng.integers(0, 3, 300_000)
    s_out = rng.integers(0, 2, 300_000)
    c_in = np.bincount(s_in, minlength=3)
    c_out = np.bincount(s_out, minlength=3)
    twice_u = sum(c_in[a] * c_out[b] * (2 * (a > b) + (a == b))
                  for a in range(3) for b in range(3))
    expected = twice_u / (2 * s_in.size * s_out.size)
    assert metrics.auroc(s_in, s_out) == pytest.approx(expected, abs=EXACT)


def test_accepts_jax_and_float32():
    rng = np.random.default_rng(2)
    s_in = rng.normal(size=50).astype(np.float32)
    s_out = rng.normal(size=60).astype(np.float32)
    expected = metrics.ood_metrics(s_in.astype(np.float64), s_out.astype(np.float64))
    got = metrics.ood_metrics(jnp.asarray(s_in), jnp.asarray(s_out))
    assert set(got) == {"auroc", "fpr95", "aupr_in", "aupr_out"}
    for key, value in got.items():
        assert isinstance(value, float)
        assert value == expected[key]
    assert got["auroc"] == pytest.approx(_sk_auroc(s_in, s_out), abs=EXACT)
    assert got["fpr95"] == pytest.approx(_sk_fpr_at_tpr(s_in, s_out, 0.95, "ood"),
                                         abs=EXACT)
    got_in = metrics.ood_metrics(s_in, s_out, positive="in")
    assert got_in["fpr95"] == pytest.approx(_sk_fpr_at_tpr(s_in, s_out, 0.95, "in"),
                                            abs=EXACT)


@pytest.mark.parametrize("fn", [metrics.auroc, metrics.fpr_at_tpr, metrics.aupr_in,
                                metrics.aupr_out, metrics.ood_metrics])
def test_bad_inputs(fn):
    good = np.array([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"scores_in.*1-D"):
        fn(good[:, None], good)
    with pytest.raises(ValueError, match=r"scores_out.*1-D"):
        fn(good, np.float64(1.0))
    with pytest.raises(ValueError, match=r"scores_in.*non-empty"):
        fn(np.array([]), good)
    with pytest.raises(ValueError, match=r"scores_out.*non-empty"):
        fn(good, [])
    with pytest.raises(ValueError, match=r"scores_in.*2 NaN and 0 infinite"):
        fn(np.array([np.nan, 1.0, np.nan]), good)
    with pytest.raises(ValueError, match=r"scores_out.*1 NaN and 2 infinite"):
        fn(good, jnp.array([np.inf, -np.inf, np.nan, 0.0]))
    with pytest.raises(ValueError, match=r"scores_in.*numeric"):
        fn(np.array(["a", "b"]), good)


def test_bad_tpr_and_accuracy_inputs():
    with pytest.raises(ValueError, match="tpr"):
        metrics.fpr_at_tpr([1.0], [0.0], tpr=0.0)
    with pytest.raises(ValueError, match="tpr"):
        metrics.fpr_at_tpr([1.0], [0.0], tpr=1.5)
    with pytest.raises(ValueError, match="positive"):
        metrics.fpr_at_tpr([1.0], [0.0], positive="id")
    with pytest.raises(ValueError, match="positive"):
        metrics.ood_metrics([1.0], [0.0], positive=None)
    with pytest.raises(ValueError, match="same shape"):
        metrics.accuracy([0, 1], [0, 1, 2])
    with pytest.raises(ValueError, match=r"predictions.*non-empty"):
        metrics.accuracy([], [])
    with pytest.raises(ValueError, match=r"labels.*1 NaN"):
        metrics.accuracy([0.0, 1.0], [math.nan, 1.0])


@pytest.mark.parametrize("case", [0, 1, 2, 5, 9, len(CASES) - 3])
@pytest.mark.parametrize("positive", ["ood", "in"])
def test_roc_curve_against_sklearn(case, positive):
    s_in, s_out = CASES[case]
    fpr, tpr, thr = metrics.roc_curve(s_in, s_out, positive=positive)
    is_in = _labels(s_in, s_out)
    scores = np.concatenate([s_in, s_out])
    y, s = (1 - is_in, -scores) if positive == "ood" else (is_in, scores)
    sk_fpr, sk_tpr, sk_thr = skm.roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr, atol=EXACT)
    np.testing.assert_allclose(tpr, sk_tpr, atol=EXACT)
    sign = -1.0 if positive == "ood" else 1.0
    np.testing.assert_array_equal(thr[1:], sign * sk_thr[1:])
    # FPR95 is read off this curve.
    assert metrics.fpr_at_tpr(s_in, s_out, positive=positive) == fpr[np.argmax(tpr >= 0.95)]
