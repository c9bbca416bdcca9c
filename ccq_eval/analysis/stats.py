"""Paired statistics for baseline-vs-variant comparisons over the same samples.

- Paired bootstrap: resample sample indices with replacement (the same indices for both
  models), recompute each model's statistic, take percentiles of the difference.
  Seeded (numpy default_rng), so every number is reproducible.
- Exact McNemar test for binary per-sample scores: two-sided binomial test (p = 1/2, as
  scipy.stats.binomtest) on the discordant pairs (b = baseline right / variant wrong, c = the
  reverse); with p = 1/2 its p-value is min(1, 2 P[X <= min(b, c)]), computed here without scipy
  (whose import alone takes seconds).
- Exact sign test for other per-sample scores: the same binomial test on the signs of the
  non-zero paired differences.
- The p-values of one output are adjusted for their number (ccq_eval.analysis.p_values: Holm by
  default); significance marks and verdicts read the adjusted p-values.

Samples are paired only when they are the same document (ccq_eval.analysis.pairing): by lm-eval's
doc_hash, or by prompt and target hash where that pairs more of them; `pairing` in the output says
which, `unpaired` how many samples had no partner. Two runs without a document in common (another
--seed) are refused, never paired by position. The tables `compare` prints are made in
ccq_eval.analysis.comparison_tables (re-exported here).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ccq_eval.analysis import sweeps
from ccq_eval.analysis.comparison_tables import (  # noqa: F401  (re-exported: what `compare` prints)
    adjust_comparisons,
    comparison_display,
    comparison_note,
    comparison_summary,
    render_comparison,
    render_comparisons,
    render_summary,
    render_verdict,
    verdict_summary,
)
from ccq_eval.analysis.p_values import (  # noqa: F401  (re-exported: the significance levels)
    DEFAULT_ALPHA,
    DEFAULT_P_ADJUST,
    P_ADJUST_METHODS,
    adjust_p_values,
    check_p_adjust,
    significance_mark,
)
from ccq_eval.analysis.pairing import (
    comparison_metrics,
    group_order,
    pair_samples,
    sample_entries,
    settings_difference,
    units_of,
)
from ccq_eval.analysis.tidy import MetricInfo, scoring_protocol, task_family
from ccq_eval.analysis.zeroshot import protocol_label
from ccq_eval.harness.store import ResultsError, StoredUnit
from ccq_eval.task_families import RECALL, ZEROSHOT

DEFAULT_BOOTSTRAP = 10_000
DEFAULT_SEED = 0
_CHUNK_ROWS = 1000  # bootstrap resamples drawn per chunk (bounds memory, same stream as one draw)

# --------------------------------------------------------------------------------------------
# Statistics of one model over (resampled) samples. Input rows are samples; for ratio
# statistics a sample is a pair (numerator, denominator).


def mean_statistic(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=-1)


def perplexity_statistic(values: np.ndarray) -> np.ndarray:
    """lm-eval 'perplexity' aggregation: exp(-mean log-likelihood)."""
    return np.exp(-values.mean(axis=-1))


def weighted_perplexity_statistic(values: np.ndarray) -> np.ndarray:
    """lm-eval 'weighted_perplexity': exp(-sum log-likelihood / sum token count)."""
    return np.exp(-values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1))


def bits_per_byte_statistic(values: np.ndarray) -> np.ndarray:
    return -values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1) / math.log(2)


def nll_pairs_statistic(values: np.ndarray) -> np.ndarray:
    """Perplexity from (nll_sum, n_tokens) pairs (our ppl tasks): exp(sum nll / sum n)."""
    return np.exp(values[..., 0].sum(axis=-1) / values[..., 1].sum(axis=-1))


STATISTICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": mean_statistic,
    "perplexity": perplexity_statistic,
    "weighted_perplexity": weighted_perplexity_statistic,
    "bits_per_byte": bits_per_byte_statistic,
    "nll_pairs": nll_pairs_statistic,
}
PAIR_STATISTICS = ("weighted_perplexity", "bits_per_byte", "nll_pairs")
LOWER_IS_BETTER = ("perplexity", "weighted_perplexity", "bits_per_byte", "nll_pairs")


@dataclass(frozen=True)
class BootstrapResult:
    delta: float  # statistic(variant) - statistic(baseline) on the observed samples
    low: float
    high: float
    n: int
    n_boot: int
    confidence: float


def paired_bootstrap(
    baseline: np.ndarray,
    variant: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray] = mean_statistic,
    *,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    confidence: float = 0.95,
) -> BootstrapResult:
    """Percentile interval of statistic(variant) - statistic(baseline) under paired resampling.

    Resample b draws indices rng.integers(0, n, size=n) (rows of one (n_boot, n) draw from
    numpy.random.default_rng(seed)) and applies them to both models.
    """
    baseline = np.asarray(baseline, dtype=float)
    variant = np.asarray(variant, dtype=float)
    if baseline.shape != variant.shape:
        raise ValueError(f"paired samples differ in shape: {baseline.shape} vs {variant.shape}")
    n = baseline.shape[0]
    if n == 0:
        raise ValueError("no paired samples to compare")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    observed = float(statistic(variant[None])[0] - statistic(baseline[None])[0])
    rng = np.random.default_rng(seed)
    deltas = np.empty(n_boot)
    for start in range(0, n_boot, _CHUNK_ROWS):
        rows = min(_CHUNK_ROWS, n_boot - start)
        index = rng.integers(0, n, size=(rows, n))
        deltas[start : start + rows] = statistic(variant[index]) - statistic(baseline[index])
    tail = (1 - confidence) / 2
    low, high = np.quantile(deltas, [tail, 1 - tail])
    return BootstrapResult(observed, float(low), float(high), n, n_boot, confidence)


_HALF_LOG_TWO_PI = 0.5 * math.log(2 * math.pi)


def _stirling_error(n: int) -> float:
    """log(n!) - log(sqrt(2 pi n) (n/e)^n): lgamma where it is small (n <= 15), else its asymptotic
    series (Loader 2000, as R's dbinom), both accurate to a few ulps."""
    if n <= 15:
        return math.lgamma(n + 1) - (n + 0.5) * math.log(n) + n - _HALF_LOG_TWO_PI
    inverse_square = 1.0 / (n * n)
    return (1 / 12 - (1 / 360 - (1 / 1260 - (1 / 1680 - inverse_square / 1188) * inverse_square)
                      * inverse_square) * inverse_square) / n


def _deviance_term(x: int, mean: float) -> float:
    """x log(x / mean) + mean - x without the cancellation of its direct form near x = mean (Loader)."""
    if abs(x - mean) >= 0.1 * (x + mean):
        return x * math.log(x / mean) + mean - x
    ratio = (x - mean) / (x + mean)
    total = (x - mean) * ratio
    power = 2 * x * ratio
    ratio_squared = ratio * ratio
    for j in range(1, 1000):
        power *= ratio_squared
        updated = total + power / (2 * j + 1)
        if updated == total:
            break
        total = updated
    return total


def _log_binomial_half_pmf(k: int, n: int) -> float:
    """log P[X = k] for X ~ Binomial(n, 1/2), to a relative error of about 1e-15 for any n."""
    if k in (0, n):
        return -n * math.log(2)
    mean = n / 2
    return (_stirling_error(n) - _stirling_error(k) - _stirling_error(n - k)
            - _deviance_term(k, mean) - _deviance_term(n - k, mean)
            + 0.5 * math.log(n / (2 * math.pi * k * (n - k))))


def _binomial_two_sided(k_small: int, total: int) -> float:
    """P-value of the exact two-sided binomial test with p = 1/2: min(1, 2 P[X <= k_small]) for
    X ~ Binomial(total, 1/2), 1 when there is nothing to test. The tail is P[X = k_small] (Loader's
    saddle-point form) times 1 + r_k + r_k r_(k-1) + ..., r_i = P[X = i - 1] / P[X = i] = i / (total - i + 1),
    summed until a term no longer changes the sum; this is scipy.stats.binomtest's p-value to about 1e-12
    relative, for any total."""
    k_small = min(k_small, total - k_small)  # the test is symmetric
    if total == 0 or 2 * k_small >= total:
        return 1.0
    term, tail = 1.0, 1.0
    for i in range(k_small, 0, -1):
        term *= i / (total - i + 1)
        if term < tail * 1e-17:
            break
        tail += term
    return min(1.0, 2.0 * math.exp(_log_binomial_half_pmf(k_small, total)) * tail)


def mcnemar_exact(baseline: np.ndarray, variant: np.ndarray) -> tuple[int, int, float]:
    """(b, c, p): b = baseline right & variant wrong, c = baseline wrong & variant right."""
    baseline = np.asarray(baseline).astype(bool)
    variant = np.asarray(variant).astype(bool)
    b = int(np.sum(baseline & ~variant))
    c = int(np.sum(~baseline & variant))
    return b, c, _binomial_two_sided(min(b, c), b + c)


def sign_test(differences: np.ndarray) -> tuple[int, int, float]:
    """(positives, negatives, p) of the exact sign test; zero differences are dropped."""
    differences = np.asarray(differences, dtype=float)
    positives = int(np.sum(differences > 0))
    negatives = int(np.sum(differences < 0))
    return positives, negatives, _binomial_two_sided(min(positives, negatives), positives + negatives)


def is_binary(*arrays: np.ndarray) -> bool:
    """Per-sample scores that are right/wrong: values all in {0, 1} or all in {0, 100}."""
    values = np.concatenate([np.asarray(a, dtype=float).ravel() for a in arrays])
    return bool(np.isin(values, (0.0, 1.0)).all() or np.isin(values, (0.0, 100.0)).all())


# --------------------------------------------------------------------------------------------
# Comparing two models in stored results


def _group_seed(seed: int, *parts: Any) -> int:
    # Each comparison gets its own stream, independent of the order groups are visited in.
    return (seed * 1_000_003 + zlib.crc32("|".join(map(str, parts)).encode())) % 2**32


def compare_models(
    units: list[StoredUnit],
    baseline: str,
    variant: str,
    *,
    metric: str | None = None,
    n_boot: int = DEFAULT_BOOTSTRAP,
    seed: int = DEFAULT_SEED,
    alpha: float = DEFAULT_ALPHA,
    p_adjust: str = DEFAULT_P_ADJUST,
) -> pd.DataFrame:
    """Per task and compared metric (pairing.comparison_metrics; per length / bucket where the task has them):
    baseline, variant, delta, paired bootstrap CI, McNemar / sign-test p-value, that p-value adjusted by
    `p_adjust` over this comparison's rows (adjust_comparisons: pass the frames of several comparisons to it
    to adjust them as one family), a significance mark, a verdict on the adjusted p-value, and for a
    zero-shot rolling task the protocol that scored it (compared_protocols)."""
    check_p_adjust(p_adjust)
    if baseline == variant:
        raise ResultsError("--baseline and --variant name the same model; give two different models")
    base_units = {t: u for u in units_of(units, baseline) for t in u.leaf_tasks()}
    var_units = {t: u for u in units_of(units, variant) for t in u.leaf_tasks()}
    shared_tasks = [t for t in base_units if t in var_units]
    if not shared_tasks:
        raise ResultsError(
            f"{baseline!r} and {variant!r} have no task in common "
            f"({baseline}: {', '.join(sorted(base_units))}; {variant}: {', '.join(sorted(var_units))})"
        )
    rows = []
    for task in sorted(shared_tasks):
        for info in comparison_metrics(base_units[task], task, metric):
            rows += _compare_task(base_units[task], var_units[task], task, info, n_boot, seed)
    if not rows:
        raise ResultsError(
            f"no per-sample logs to pair for {baseline!r} and {variant!r}: the comparison needs the "
            "samples_<task>.jsonl files that `ccq-eval run` writes, with the same documents for both"
        )
    frame = pd.DataFrame(rows)
    frame["_order"] = frame["length"].map(group_order)
    frame = frame.sort_values(["task", "metric", "_order"], kind="stable").drop(columns="_order")
    return adjust_comparisons([frame.reset_index(drop=True)], p_adjust, alpha)[0]


def _compare_task(base_unit: StoredUnit, var_unit: StoredUnit, task: str, info: MetricInfo, n_boot: int,
                  seed: int) -> list[dict]:
    """The rows of one task and metric: a row per group (all, length, bucket) with paired samples."""
    base_groups = sample_entries(base_unit, task, info)
    var_groups = sample_entries(var_unit, task, info)
    shared_groups = [group for group in base_groups if group in var_groups]
    paired = {group: pair_samples(base_groups[group], var_groups[group]) for group in shared_groups}
    if shared_groups and not any(pairs for pairs, _, _ in paired.values()):
        differ = settings_difference(base_unit, var_unit)
        raise ResultsError(
            f"{base_unit.model!r} and {var_unit.model!r} share no document of {task}"
            + (f" (their settings differ: {differ})" if differ else "")
            + ": paired statistics need the same documents; run both models with the same --seed and "
            "task settings into one folder")
    rows = []
    protocol = compared_protocols(base_unit, var_unit, task)
    for group in shared_groups:
        pairs, mode, unpaired = paired[group]
        if pairs:
            rows.append(_compare_group(task, group, info, pairs, mode, unpaired, n_boot,
                                       _group_seed(seed, task, group, info.name)) | {"protocol": protocol})
    return rows


def compared_protocols(base_unit: StoredUnit, var_unit: StoredUnit, task: str) -> str:
    """How the two models' texts of a zero-shot rolling task were scored (tidy.scoring_protocol): "HFLM
    windows" when both say so, "HFLM windows vs state carried" when they differ (baseline first); the same for
    a recall task's rules ("jrt, 2048 tokens"); "" for any other task."""
    if task_family(task) not in (ZEROSHOT.name, RECALL.name):
        return ""
    found = [scoring_protocol(unit, task) for unit in (base_unit, var_unit)]
    if found == [None, None]:
        return ""
    labels = list(dict.fromkeys(protocol_label(protocol) for protocol in found))
    return " vs ".join(labels) if len(labels) > 1 else labels[0]


def _compare_group(task: str, group: Any, info: MetricInfo, pairs: list[tuple[dict, dict]],
                   pairing: str, unpaired: int, n_boot: int, seed: int) -> dict:
    """One group's row: statistics, bootstrap interval and test (sig and verdict: adjust_comparisons)."""
    base = np.array([b["value"] for b, _ in pairs], dtype=float)
    var = np.array([v["value"] for _, v in pairs], dtype=float)
    aggregation = info.aggregation if info.aggregation in STATISTICS else "mean"
    if base.ndim == 2 and aggregation not in PAIR_STATISTICS:
        aggregation = "weighted_perplexity"  # lm-eval's (log-likelihood, count) pairs
    statistic = STATISTICS[aggregation]
    if not (np.isfinite(base).all() and np.isfinite(var).all()):
        return _failed_group(task, group, info, aggregation, base, var, pairing, unpaired)
    boot = paired_bootstrap(base, var, statistic, n_boot=n_boot, seed=seed)
    if base.ndim == 1 and aggregation == "mean" and is_binary(base, var):
        b, c, p_value = mcnemar_exact(base, var)
        test = f"McNemar exact (b={b}, c={c})"
    else:
        if base.ndim == 2:  # per-document NLL (or log-likelihood) per token
            per_doc_base, per_doc_var = base[:, 0] / base[:, 1], var[:, 0] / var[:, 1]
        else:
            per_doc_base, per_doc_var = base, var
        plus, minus, p_value = sign_test(per_doc_var - per_doc_base)
        test = f"sign test (+{plus}/-{minus})"
    return {
        "task": task,
        "length": group,
        "metric": info.name,
        "statistic": aggregation,
        "n": boot.n,
        "baseline": float(statistic(base[None])[0]),
        "variant": float(statistic(var[None])[0]),
        "delta": boot.delta,
        "ci_low": boot.low if boot.n > 1 else math.nan,  # resampling one pair gives no interval ("-")
        "ci_high": boot.high if boot.n > 1 else math.nan,
        "p_value": p_value,
        "test": test,
        "sig": "",
        "verdict": "not significant",
        "pairing": pairing,
        "unpaired": unpaired,
        "higher_is_better": _higher_is_better(aggregation, info),
    }


def _higher_is_better(aggregation: str, info: MetricInfo) -> bool:
    if aggregation in LOWER_IS_BETTER:
        return False
    return True if info.higher_is_better is None else bool(info.higher_is_better)


def _failed_group(task: str, group: Any, info: MetricInfo, aggregation: str, base: np.ndarray,
                  var: np.ndarray, pairing: str, unpaired: int) -> dict:
    """The row of a group where a model's per-sample values are not all finite (its unit failed): the
    statistics as they come out (NaN or inf), no interval and no test."""
    statistic = STATISTICS[aggregation]
    baseline, variant = float(statistic(base[None])[0]), float(statistic(var[None])[0])
    return {"task": task, "length": group, "metric": info.name, "statistic": aggregation, "n": len(base),
            "baseline": baseline, "variant": variant, "delta": variant - baseline, "ci_low": math.nan,
            "ci_high": math.nan, "p_value": math.nan, "test": "none: non-finite values", "sig": "",
            "verdict": "failed", "pairing": pairing, "unpaired": unpaired,
            "higher_is_better": _higher_is_better(aggregation, info)}


def ccq_pairs(models: Iterable[str]) -> list[tuple[str, str]]:
    """Every (NAME, NAME-ccq) pair among `models`, in name order: the CCQ twins."""
    names = set(models)
    return [(name, name + "-ccq") for name in sorted(names) if name + "-ccq" in names]


def comparison_pairs(units: Iterable[StoredUnit]) -> list[tuple[str, str]]:
    """The (baseline, variant) comparisons `compare` and the report make when none is named: every CCQ twin
    pair NAME / NAME-ccq, then every --ccq-attach sweep's lambda = 0 (the plain model) against each of its
    other lambdas in increasing order (sweeps.sweep_points: read from the units' specs, not their names)."""
    units = list(units)
    attachments = sweeps.sweep_attachments((unit.model, unit.meta) for unit in units)
    pairs = ccq_pairs(unit.model for unit in units)
    for _, members in sweeps.sweep_points(attachments, {unit.model for unit in units}).groupby("sweep", sort=True):
        members = members.sort_values("lambda")
        zero = members[members["lambda"] == 0]
        if not zero.empty:
            pairs += [(zero["model"].iloc[0], model) for model in members.loc[members["lambda"] > 0, "model"]]
    return pairs


def verdict_table(units: Iterable[StoredUnit], compared: Iterable[tuple[str, str, pd.DataFrame]], *,
                  alpha: float = DEFAULT_ALPHA, p_adjust: str = DEFAULT_P_ADJUST) -> tuple[pd.DataFrame, str]:
    """(table, note) of the verdict: a row per compared (baseline, variant, compare_models frame), a column
    per task, p-values adjusted over its cells (comparison_tables.verdict_summary), rows grouped by the
    backbone the units record where pairs cross families. The one source of `compare --summary` and of the
    report's first table."""
    backbones = {unit.model: unit.backbone for unit in units}
    return verdict_summary(compared, p_adjust, alpha, backbones)
