"""Paired bootstrap, exact McNemar and sign tests against hand-computed and direct numpy values."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from ccq_eval.analysis import stats


def test_bootstrap_matches_direct_numpy_reimplementation():
    rng = np.random.default_rng(7)
    base = rng.integers(0, 2, size=37).astype(float)
    var = rng.integers(0, 2, size=37).astype(float)
    result = stats.paired_bootstrap(base, var, n_boot=2500, seed=11)

    # Direct re-implementation: one (n_boot, n) draw of indices, same for both models.
    index = np.random.default_rng(11).integers(0, 37, size=(2500, 37))
    deltas = var[index].mean(axis=1) - base[index].mean(axis=1)
    assert result.delta == pytest.approx(var.mean() - base.mean())
    assert result.low == pytest.approx(np.quantile(deltas, 0.025))
    assert result.high == pytest.approx(np.quantile(deltas, 0.975))
    # deterministic for a seed, different for another
    again = stats.paired_bootstrap(base, var, n_boot=2500, seed=11)
    assert (again.low, again.high) == (result.low, result.high)


def test_bootstrap_two_samples_by_hand():
    """n = 2, differences d = (-1, 3): a resample's mean difference is -1 (p 1/4), 1 (p 1/2)
    or 3 (p 1/4), so the 95% percentile interval is exactly [-1, 3] and the delta 1."""
    base = np.array([1.0, 0.0])
    var = np.array([0.0, 3.0])
    result = stats.paired_bootstrap(base, var, n_boot=4000, seed=0)
    assert result.delta == 1.0
    assert (result.low, result.high) == (-1.0, 3.0)
    narrow = stats.paired_bootstrap(base, var, n_boot=4000, seed=0, confidence=0.4)
    assert (narrow.low, narrow.high) == (1.0, 1.0)  # the middle 40% is all at the mean


def test_identical_models_give_zero_delta_and_interval_containing_zero():
    values = np.array([0.0, 100.0, 100.0, 0.0, 100.0, 50.0])
    result = stats.paired_bootstrap(values, values.copy(), n_boot=1000, seed=3)
    assert result.delta == 0.0 and result.low == 0.0 and result.high == 0.0
    assert stats.mcnemar_exact(values > 0, values > 0)[2] == 1.0
    assert stats.sign_test(values - values)[2] == 1.0


def test_ratio_statistic_bootstrap_resamples_documents():
    """Perplexity from (nll_sum, tokens) pairs: exp(sum nll / sum tokens) over resampled docs."""
    base = np.array([[20.0, 10.0], [30.0, 10.0], [10.0, 5.0]])
    var = np.array([[15.0, 10.0], [25.0, 10.0], [10.0, 5.0]])
    result = stats.paired_bootstrap(base, var, stats.nll_pairs_statistic, n_boot=2000, seed=5)
    assert result.delta == pytest.approx(math.exp(50 / 25) - math.exp(60 / 25))
    index = np.random.default_rng(5).integers(0, 3, size=(2000, 3))
    deltas = (np.exp(var[index][..., 0].sum(1) / var[index][..., 1].sum(1))
              - np.exp(base[index][..., 0].sum(1) / base[index][..., 1].sum(1)))
    assert result.low == pytest.approx(np.quantile(deltas, 0.025))
    assert result.high <= 0  # the variant is never worse on any document


def test_mcnemar_exact_by_hand():
    # b = 1 (baseline right, variant wrong), c = 9: p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22/1024
    base = np.array([1] * 1 + [0] * 9 + [1] * 5 + [0] * 5)
    var = np.array([0] * 1 + [1] * 9 + [1] * 5 + [0] * 5)
    b, c, p = stats.mcnemar_exact(base, var)
    assert (b, c) == (1, 9)
    assert p == pytest.approx(22 / 1024)
    # symmetric, and capped at 1 when b == c
    assert stats.mcnemar_exact(var, base)[2] == pytest.approx(22 / 1024)
    assert stats.mcnemar_exact(np.array([1, 0]), np.array([0, 1]))[2] == 1.0


def test_mcnemar_agrees_with_scipy_binomtest():
    scipy_stats = pytest.importorskip("scipy.stats")
    for b, c in [(0, 4), (3, 12), (7, 9), (20, 5)]:
        base = np.array([1] * b + [0] * c)
        var = np.array([0] * b + [1] * c)
        expected = scipy_stats.binomtest(min(b, c), b + c, 0.5).pvalue
        assert stats.mcnemar_exact(base, var)[2] == pytest.approx(expected, rel=1e-12)


# (n, k): small n, both tails, k = n/2 and (n-1)/2 (p = 1), far tails near underflow, and large n near the
# centre, where many terms of the tail count
BINOMIAL_CASES = [(1, 0), (2, 0), (2, 2), (5, 1), (11, 5), (20, 3), (20, 17), (101, 50), (1000, 1), (1000, 100),
                  (1000, 469), (10**4, 3333), (10**4, 4900), (10**5, 49800), (10**6, 499000), (10**6, 500000),
                  (10**7, 4990514)]


@pytest.mark.parametrize(("total", "k"), BINOMIAL_CASES)
def test_binomial_two_sided_equals_scipy_binomtest(total, k):
    scipy_stats = pytest.importorskip("scipy.stats")
    expected = scipy_stats.binomtest(k, total, 0.5, alternative="two-sided").pvalue
    assert stats._binomial_two_sided(k, total) == pytest.approx(expected, rel=1e-11, abs=1e-300)


def test_binomial_two_sided_by_exact_fractions():
    # 2 * sum_{i <= k} C(n, i) / 2^n in exact integer arithmetic
    for total in range(1, 60):
        for k in range(total // 2 + 1):
            exact = min(1.0, 2 * sum(math.comb(total, i) for i in range(k + 1)) / 2**total)
            assert stats._binomial_two_sided(k, total) == pytest.approx(exact, rel=1e-13), (total, k)


def test_comparisons_import_no_scipy():
    # scipy.stats alone takes seconds to import; `ccq-eval compare` must not need it
    code = ("import sys, numpy as np; from ccq_eval.analysis import stats; "
            "stats.mcnemar_exact(np.array([1, 0, 1]), np.array([0, 0, 0])); stats.sign_test(np.array([1.0, -2.0]));"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'scipy'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_sign_test_by_hand():
    # five positive, one negative, one tie (dropped): p = 2 * (1 + 6) / 2^6 = 14/64
    plus, minus, p = stats.sign_test(np.array([0.5, 1.0, 2.0, 0.1, 3.0, -1.0, 0.0]))
    assert (plus, minus) == (5, 1)
    assert p == pytest.approx(14 / 64)


def test_binary_detection_and_marks():
    assert stats.is_binary(np.array([0.0, 100.0]), np.array([100.0, 100.0]))
    assert stats.is_binary(np.array([0, 1, 1]))
    assert not stats.is_binary(np.array([0.0, 50.0]))
    assert [stats.significance_mark(p) for p in (0.2, 0.04, 0.009, 0.0009)] == ["", "*", "**", "***"]


def test_bootstrap_rejects_mismatched_or_empty_input():
    with pytest.raises(ValueError, match="shape"):
        stats.paired_bootstrap(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="no paired samples"):
        stats.paired_bootstrap(np.zeros(0), np.zeros(0))
