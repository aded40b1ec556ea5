"""Out-of-distribution detection metrics: AUROC, FPR@TPR, AUPR-in/out, accuracy.

Convention used throughout (the same as the rest of ``dpmm_jax``): a **higher score
means more in-distribution**. ``scores_in`` are the scores of ID test points, shape
(M,), and ``scores_out`` the scores of out-of-distribution (OOD) test points, shape
(M_ood,).

Which class is "positive" matters for the FPR at a fixed TPR, and the field uses two
conventions that differ by a factor of two or more on the same scores:

* ``positive="ood"`` (the default): **OOD is the positive class**, as in OpenOOD v1.5
  and pytorch-ood. FPR95 is the share of ID points flagged as OOD when the threshold
  catches 95 % of the OOD points.
* ``positive="in"``: ID is the positive class (the older convention of many papers):
  the share of OOD points accepted as ID when 95 % of the ID points are accepted.

AUROC is the same under both conventions; AUPR-in and AUPR-out are the average
precision with ID, respectively OOD, as the positive class (scikit-learn's
``average_precision_score``; OpenOOD integrates the precision-recall curve with the
trapezoidal rule instead, which differs slightly on small or heavily tied sets).

The functions are host-side numpy code: they accept numpy or JAX arrays (or lists),
copy them to float64 numpy arrays (an exact conversion for float32 scores, so ties and
orderings are preserved), and return Python floats. All of them are exact (no
binning), and they agree with scikit-learn's ``roc_auc_score``, ``roc_curve`` and
``average_precision_score``, including in the presence of tied scores.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

__all__ = [
    "FPR_CONVENTIONS",
    "auroc",
    "fpr_at_tpr",
    "roc_curve",
    "aupr_in",
    "aupr_out",
    "accuracy",
    "ood_metrics",
]


# ``positive=`` values of :func:`fpr_at_tpr`, with the short names used in table headers.
FPR_CONVENTIONS = {"ood": "OpenOOD v1.5, OOD positive", "in": "ID positive"}


def _check_positive(positive: str) -> str:
    if positive not in FPR_CONVENTIONS:
        raise ValueError(f"positive must be one of {sorted(FPR_CONVENTIONS)}, got "
                         f"{positive!r}.")
    return positive


def _validate_scores(x: Any, name: str) -> np.ndarray:
    """Converts ``x`` to a 1-D float64 numpy array and checks it.

    Args:
      x: array-like of scores, shape (M,).
      name: the argument's name, used in error messages.

    Returns:
      A float64 numpy array of shape (M,).

    Raises:
      ValueError: if ``x`` is not 1-D, is empty, is not numeric, or holds NaN or
        infinite entries (the message gives the argument's name and the counts).
    """
    arr = np.asarray(x)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number)
                                   or np.issubdtype(arr.dtype, np.bool_)):
        raise ValueError(f"{name} must be a numeric array, got dtype {arr.dtype}.")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}.")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty.")
    if np.iscomplexobj(arr):
        raise ValueError(f"{name} must be real-valued, got dtype {arr.dtype}.")
    arr = arr.astype(np.float64)
    num_nan = int(np.count_nonzero(np.isnan(arr)))
    num_inf = int(np.count_nonzero(np.isinf(arr)))
    if num_nan or num_inf:
        raise ValueError(
            f"{name} must be finite: it has {num_nan} NaN and {num_inf} infinite "
            f"entries out of {arr.size}.")
    return arr


def _validate_pair(scores_in: Any, scores_out: Any) -> Tuple[np.ndarray, np.ndarray]:
    """``_validate_scores`` of the ID (M,) and OOD (M_ood,) scores, in that order."""
    return (_validate_scores(scores_in, "scores_in"),
            _validate_scores(scores_out, "scores_out"))


def auroc(scores_in: Any, scores_out: Any) -> float:
    r"""Area under the ROC curve, ID positive, computed exactly (Mann-Whitney U).

    .. math::
        \mathrm{AUROC} = \frac{1}{M M_{ood}} \sum_{i,j}
            \big[\mathbb{1}(s^{in}_i > s^{out}_j) + \tfrac12 \mathbb{1}(s^{in}_i = s^{out}_j)\big],

    i.e. the probability that a random ID point scores higher than a random OOD point,
    with ties counted as one half. This equals the Mann-Whitney statistic with
    mid-ranks for ties, and the trapezoidal area under the (tie-aware) ROC curve that
    ``sklearn.metrics.roc_auc_score`` returns. Cost O((M + M_ood) log M_ood).

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).

    Returns:
      The AUROC in [0, 1] as a Python float.

    Raises:
      ValueError: if an input is not 1-D, is empty or holds NaN/inf entries.
    """
    s_in, s_out = _validate_pair(scores_in, scores_out)
    s_out = np.sort(s_out)
    num_below = np.searchsorted(s_out, s_in, side="left")  # OOD scores < s_in[i]
    num_at_or_below = np.searchsorted(s_out, s_in, side="right")  # <= s_in[i]
    # Integer counts summed in int64 are exact; halve the tie count at the end.
    twice_u = 2 * int(num_below.sum()) + int((num_at_or_below - num_below).sum())
    return float(twice_u / (2.0 * s_in.size * s_out.size))


def fpr_at_tpr(scores_in: Any, scores_out: Any, tpr: float = 0.95, *,
               positive: str = "ood") -> float:
    r"""False-positive rate at the threshold where the positives' recall reaches ``tpr``.

    ``positive="ood"`` (default; OpenOOD v1.5 and pytorch-ood): OOD points are the
    positives and a point is flagged OOD when its score is ``<= u``. With
    ``TPR(u) = #{j: s_out_j <= u} / M_ood`` and ``FPR(u) = #{i: s_in_i <= u} / M``
    the threshold is the smallest ``u`` with ``TPR(u) >= tpr`` and the function returns
    ``FPR(u)``: the share of ID points rejected when ``tpr`` of the OOD points are
    caught. This equals ``fpr[argmax(tpr_curve >= tpr)]`` of
    ``sklearn.metrics.roc_curve(is_ood, -scores)``, which is how OpenOOD computes it.

    ``positive="in"``: ID points are the positives and a point is accepted as ID when
    its score is ``>= t``; ``TPR(t) = #{i: s_in_i >= t} / M``,
    ``FPR(t) = #{j: s_out_j >= t} / M_ood``, ``t* = max{t : TPR(t) >= tpr}`` (the
    ``k``-th largest ID score with ``k = min{k : k / M >= tpr}``) and the function
    returns ``FPR(t*)``: the share of OOD points accepted when ``tpr`` of the ID
    points are. This equals ``fpr[argmax(tpr_curve >= tpr)]`` of
    ``sklearn.metrics.roc_curve(is_id, scores)``.

    The "ood" value is the "in" value with the roles of the two sets exchanged and the
    scores negated. In both, ties are handled conservatively: negatives whose score
    equals the threshold count as false positives (they cannot be separated from the
    positives there); sklearn's ``roc_curve`` does the same, with or without
    ``drop_intermediate``. With ``tpr=0.95`` this is the usual "FPR95".

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).
      tpr: target true-positive rate of the positive class, in (0, 1].
      positive: ``"ood"`` (default) or ``"in"``, the positive class.

    Returns:
      The FPR in [0, 1] as a Python float.

    Raises:
      ValueError: if an input is not 1-D, is empty or holds NaN/inf entries, if
        ``tpr`` is not in (0, 1], or ``positive`` is not ``"ood"`` or ``"in"``.
    """
    s_in, s_out = _validate_pair(scores_in, scores_out)
    tpr = float(tpr)
    if not 0.0 < tpr <= 1.0:
        raise ValueError(f"tpr must be in (0, 1], got {tpr}.")
    if _check_positive(positive) == "ood":
        return _fpr_positive_high(-s_out, -s_in, tpr)
    return _fpr_positive_high(s_in, s_out, tpr)


def roc_curve(scores_in: Any, scores_out: Any, *,
              positive: str = "ood") -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ROC curve at every distinct score threshold, for plotting.

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).
      positive: ``"ood"`` (default; a point is flagged OOD when its score is ``<= u``)
        or ``"in"`` (accepted as ID when its score is ``>= t``).

    Returns:
      ``(fpr, tpr, thresholds)``, each of shape (T + 1,) for T distinct scores: the
      rates of the negatives and positives called positive at each threshold, from
      ``(0, 0)`` (nothing called positive, threshold ``inf`` or ``-inf``) to
      ``(1, 1)``; ``thresholds`` are scores (negated back for ``"ood"``). This is
      ``sklearn.metrics.roc_curve(..., drop_intermediate=False)`` of the same convention.

    Raises:
      ValueError: as :func:`fpr_at_tpr`.
    """
    s_in, s_out = _validate_pair(scores_in, scores_out)
    if _check_positive(positive) == "ood":
        pos, neg, sign = -s_out, -s_in, -1.0
    else:
        pos, neg, sign = s_in, s_out, 1.0
    thresholds = np.unique(np.concatenate([pos, neg]))[::-1]
    pos_sorted, neg_sorted = np.sort(pos), np.sort(neg)
    tp = pos.size - np.searchsorted(pos_sorted, thresholds, side="left")
    fp = neg.size - np.searchsorted(neg_sorted, thresholds, side="left")
    fpr = np.concatenate([[0.0], fp / neg.size])
    tpr = np.concatenate([[0.0], tp / pos.size])
    return fpr, tpr, sign * np.concatenate([[np.inf], thresholds])


def _fpr_positive_high(s_pos: np.ndarray, s_neg: np.ndarray, tpr: float) -> float:
    """FPR of negatives at the largest threshold where positives' recall >= tpr.

    Positives score high; a point is called positive when its score is ``>= t``.
    """
    m = s_pos.size
    s_pos_desc = np.sort(s_pos)[::-1]
    # Recall reached when the threshold is the k-th largest positive score is at least
    # k/M; the division is done as in roc_curve (float counts / float total).
    recall_at_k = np.arange(1, m + 1, dtype=np.float64) / float(m)
    k = int(np.argmax(recall_at_k >= tpr))  # zero-based; tpr <= 1 so always found.
    threshold = s_pos_desc[k]
    return float(np.count_nonzero(s_neg >= threshold) / s_neg.size)


def _average_precision(scores_pos: np.ndarray, scores_neg: np.ndarray) -> float:
    r"""Average precision of separating positives (higher scores) from negatives.

    ``AP = sum_n (R_n - R_{n-1}) P_n`` over the distinct score thresholds taken in
    decreasing order, where ``P_n`` and ``R_n`` are precision and recall when every
    point scoring ``>=`` the n-th threshold is called positive (``R_0 = 0``). Tied
    scores enter as one threshold. This is the definition of
    ``sklearn.metrics.average_precision_score`` (no interpolation).

    Args:
      scores_pos: validated float64 scores of positives, shape (P,).
      scores_neg: validated float64 scores of negatives, shape (Q,).

    Returns:
      Average precision as a Python float.
    """
    scores = np.concatenate([scores_pos, scores_neg])
    is_pos = np.concatenate([np.ones(scores_pos.size, np.int64),
                             np.zeros(scores_neg.size, np.int64)])
    order = np.argsort(-scores, kind="stable")
    scores, is_pos = scores[order], is_pos[order]
    # Last index of each run of equal scores (scores are sorted decreasingly).
    last_of_run = np.flatnonzero(np.diff(scores) != 0)
    last_of_run = np.append(last_of_run, scores.size - 1)
    true_pos = np.cumsum(is_pos)[last_of_run].astype(np.float64)
    predicted_pos = (last_of_run + 1).astype(np.float64)
    precision = true_pos / predicted_pos
    recall = true_pos / true_pos[-1]
    recall_step = np.diff(recall, prepend=0.0)
    return float(np.sum(recall_step * precision))


def aupr_in(scores_in: Any, scores_out: Any) -> float:
    """Area under the precision-recall curve with ID as the positive class.

    Computed as average precision (step-wise, no interpolation), matching
    ``sklearn.metrics.average_precision_score(y, s)`` with ``y = 1`` for ID points and
    ``s`` the scores. Its chance level is ``M / (M + M_ood)``.

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).

    Returns:
      AUPR-in in [0, 1] as a Python float.

    Raises:
      ValueError: if an input is not 1-D, is empty or holds NaN/inf entries.
    """
    return _average_precision(*_validate_pair(scores_in, scores_out))


def aupr_out(scores_in: Any, scores_out: Any) -> float:
    """Area under the precision-recall curve with OOD as the positive class.

    OOD points are the positives and the negated scores rank them (a lower score is
    more OOD): this equals ``sklearn.metrics.average_precision_score(y, -s)`` with
    ``y = 1`` for OOD points. Its chance level is ``M_ood / (M + M_ood)``.

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).

    Returns:
      AUPR-out in [0, 1] as a Python float.

    Raises:
      ValueError: if an input is not 1-D, is empty or holds NaN/inf entries.
    """
    s_in, s_out = _validate_pair(scores_in, scores_out)
    return _average_precision(-s_out, -s_in)


def accuracy(predictions: Any, labels: Any) -> float:
    """Fraction of predictions equal to the labels.

    Args:
      predictions: predicted class indices, shape (M,).
      labels: true class indices, shape (M,).

    Returns:
      Accuracy in [0, 1] as a Python float.

    Raises:
      ValueError: if an input is not 1-D, is empty, holds NaN/inf entries, or the
        two lengths differ.
    """
    pred = _validate_scores(predictions, "predictions")
    lab = _validate_scores(labels, "labels")
    if pred.shape != lab.shape:
        raise ValueError(
            f"predictions and labels must have the same shape, got {pred.shape} "
            f"and {lab.shape}.")
    return float(np.count_nonzero(pred == lab) / pred.size)


def ood_metrics(scores_in: Any, scores_out: Any, *,
                positive: str = "ood") -> Dict[str, float]:
    """All OOD detection metrics at once.

    Args:
      scores_in: scores of ID points, shape (M,). Higher = more in-distribution.
      scores_out: scores of OOD points, shape (M_ood,).
      positive: the FPR95 convention, ``"ood"`` (default, OpenOOD v1.5) or ``"in"``;
        see :func:`fpr_at_tpr`.

    Returns:
      A dict with Python floats under the keys ``"auroc"`` (see :func:`auroc`),
      ``"fpr95"`` (:func:`fpr_at_tpr` with ``tpr=0.95`` and ``positive``),
      ``"aupr_in"`` and ``"aupr_out"``.

    Raises:
      ValueError: if an input is not 1-D, is empty or holds NaN/inf entries, or
        ``positive`` is not ``"ood"`` or ``"in"``.
    """
    s_in, s_out = _validate_pair(scores_in, scores_out)
    return {
        "auroc": auroc(s_in, s_out),
        "fpr95": fpr_at_tpr(s_in, s_out, tpr=0.95, positive=positive),
        "aupr_in": aupr_in(s_in, s_out),
        "aupr_out": aupr_out(s_in, s_out),
    }
