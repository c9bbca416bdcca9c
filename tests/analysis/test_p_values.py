"""Adjusting p-values for their number (ccq_eval.analysis.p_values): Holm and Bonferroni against values
computed by hand (the example of R's p.adjust and pingouin.multicomp), and Holm against its definition:
the adjusted p-value is the smallest level at which Holm's step-down procedure rejects the hypothesis."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ccq_eval.analysis import p_values

# R's p.adjust(c(.50, .003, .32, .054, .0003), "holm") and pingouin.multicomp's documented example, by hand:
# sorted 0.0003 * 5, 0.003 * 4, 0.054 * 3, 0.32 * 2 and 0.5 * 1 raised to the running maximum 0.64
P_VALUES = [0.50, 0.003, 0.32, 0.054, 0.0003]


def test_holm_and_bonferroni_by_hand():
    assert p_values.adjust_p_values(P_VALUES, "holm") == pytest.approx([0.64, 0.012, 0.64, 0.162, 0.0015],
                                                                       rel=1e-12)
    assert p_values.adjust_p_values(P_VALUES, "bonferroni") == pytest.approx([1.0, 0.015, 1.0, 0.27, 0.0015],
                                                                             rel=1e-12)
    assert p_values.adjust_p_values(P_VALUES, "none").tolist() == P_VALUES
    # a NaN (no test) is not counted: four p-values, and it stays NaN
    with_nan = p_values.adjust_p_values([0.50, 0.003, math.nan, 0.054, 0.0003], "holm")
    assert math.isnan(with_nan[2])
    assert np.delete(with_nan, 2) == pytest.approx([0.5, 0.009, 0.108, 0.0012], rel=1e-12)
    with pytest.raises(ValueError, match="holm, bonferroni, none"):
        p_values.adjust_p_values(P_VALUES, "fdr")


def _holm_rejections(p: np.ndarray, alpha: float) -> set[int]:
    """Holm's procedure itself: reject p_(1), p_(2), ... while p_(j) <= alpha / (m - j + 1)."""
    rejected = set()
    for j, index in enumerate(np.argsort(p, kind="stable")):
        if p[index] > alpha / (len(p) - j):
            break
        rejected.add(int(index))
    return rejected


def test_holm_adjusted_p_is_the_smallest_level_at_which_holm_rejects():
    rng = np.random.default_rng(0)
    for size in (1, 2, 7, 40):
        p = np.concatenate([rng.uniform(0, 0.02, size // 2), rng.uniform(0, 1, size - size // 2)])
        adjusted = p_values.adjust_p_values(p, "holm")
        for alpha in np.linspace(0.001, 0.5, 60):
            assert _holm_rejections(p, alpha) == {i for i in range(size) if adjusted[i] <= alpha}
