"""Reading many p-values at once: adjustment for multiple comparisons and significance marks.

`compare` prints a p-value per task, length and pair of models, dozens at a time; among so many, a few
fall below 0.05 by chance alone. The family-wise adjustments here control the chance of any false
finding among all the p-values one output prints (its "family"):

- holm (the default): Holm's step-down method (Holm 1979, Scand. J. Statist. 6:65-70). With the m
  p-values sorted, p_(1) <= ... <= p_(m), the adjusted p_(i) is max over j <= i of min(1, (m - j + 1) p_(j));
  it rejects at least what Bonferroni rejects, under any dependence between the tests;
- bonferroni: min(1, m p);
- none: the raw p-values.

A p-value that is NaN (a comparison whose values failed: no test) is not a member of the family and stays
NaN, as in R's p.adjust and pingouin.multicomp.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ccq_eval.analysis.formatting import AnalysisOptionError

P_ADJUST_METHODS = ("holm", "bonferroni", "none")
DEFAULT_P_ADJUST = "holm"
DEFAULT_ALPHA = 0.05
METHOD_NAMES = {"holm": "Holm", "bonferroni": "Bonferroni", "none": "none"}


def check_p_adjust(method: str) -> None:
    if method not in P_ADJUST_METHODS:
        raise AnalysisOptionError(f"--p-adjust {method!r}: valid methods are {', '.join(P_ADJUST_METHODS)}")


def adjust_p_values(p_values: Sequence[float] | np.ndarray, method: str = DEFAULT_P_ADJUST) -> np.ndarray:
    """The p-values adjusted for their number by `method` (holm, bonferroni or none), in their order; NaN
    entries are left out of the count and stay NaN."""
    check_p_adjust(method)
    raw = np.asarray(p_values, dtype=float).ravel()
    adjusted = np.full(raw.shape, np.nan)
    tested = np.flatnonzero(~np.isnan(raw))
    count = len(tested)
    if method == "none" or count == 0:
        adjusted[tested] = raw[tested]
    elif method == "bonferroni":
        adjusted[tested] = np.minimum(1.0, count * raw[tested])
    else:
        order = tested[np.argsort(raw[tested], kind="stable")]
        stepped = raw[order] * np.arange(count, 0, -1)  # (m - j + 1) p_(j), j = 1..m
        adjusted[order] = np.minimum(1.0, np.maximum.accumulate(stepped))
    return adjusted


def family_size(p_values: Sequence[float] | np.ndarray) -> int:
    """How many of `p_values` an adjustment counts (those that are not NaN)."""
    return int(np.count_nonzero(~np.isnan(np.asarray(p_values, dtype=float))))


def significance_mark(p_value: float, alpha: float = DEFAULT_ALPHA) -> str:
    if p_value < alpha / 50:
        return "***"
    if p_value < alpha / 5:
        return "**"
    if p_value < alpha:
        return "*"
    return ""
