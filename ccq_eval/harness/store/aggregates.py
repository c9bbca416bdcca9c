"""Aggregates recomputed from a unit's per-sample values: one rule for every task, applied by every reader.

lm-eval computes each metric of a task by aggregating the values its process_results returned per
document, and its samples file logs those values under the metric's name (one record per document and
filter). So a results file's "<metric>,<filter>" value can be recomputed from the records of that filter,
given how the metric aggregates:

- results.json's configs[task]["metric_list"] names it (an entry without one takes lm-eval's default for
  the metric's name, as lm-eval's ConfigurableTask does): S-NIAH, RULER, LongBench(-E) and lm-eval's own
  tasks (acc, acc_norm, perplexity, word_perplexity, byte_perplexity, bits_per_byte, ...);
- the perplexity tasks (ccq_ppl_*) declare their metrics in their task class (tasks/ppl/utils.py) rather
  than in metric_list: PERPLEXITY_AGGREGATIONS mirrors those declarations.

Recomputed are lm-eval's aggregations over numbers or (value, weight) pairs (NUMBER_AGGREGATIONS,
PAIR_AGGREGATIONS, computed by lm-eval's own functions from its registry) and the perplexity tasks' own.
Left unchecked are metrics with any other aggregation (a task's own function, which results.json holds
only as source text; corpus-level scores such as f1, bleu or matthews_corrcoef over labels and texts),
metrics of a task without a metric_list that is not ours (a task class may declare anything), and
metrics whose per-sample values are not numbers of the shape the aggregation takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccq_eval.harness.store.files import ResultsError

# lm-eval aggregations (lm_eval/api/metrics.py) whose per-sample values are numbers ...
NUMBER_AGGREGATIONS = ("mean", "median", "nanmean", "perplexity")
# ... and those whose per-sample values are (value, weight) pairs, e.g. (log-likelihood, words).
PAIR_AGGREGATIONS = ("weighted_perplexity", "bits_per_byte")
# Relative: the stored value and the recomputed one aggregate the same floats, possibly summed in another
# order. The absolute floor only covers aggregates that are zero up to rounding (sums of signed values).
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Aggregation:
    """How one metric aggregates: its name (for messages), whether its per-sample values are (value, weight)
    pairs, and the function of the list of per-sample values."""

    name: str
    pairs: bool
    function: Callable[[list[Any]], float]


def _nll_perplexity(pairs: list[tuple[float, float]]) -> float:
    """exp(total NLL / total tokens) over (nll_sum, n_tokens) pairs: the perplexity tasks' `ppl`."""
    count = math.fsum(pair[1] for pair in pairs)
    return math.exp(math.fsum(pair[0] for pair in pairs) / count) if count else float("nan")


def _sum(values: list[float]) -> float:
    return math.fsum(values)


# The perplexity tasks' metrics by the name before "@<length>" / "@<start>-<end>": tasks/ppl/utils.py
# declares ppl as the token-weighted perplexity of (nll_sum, n_tokens) pairs, nll, tokens and docs as sums
# and doc_ppl as lm-eval's mean (_PerplexityTask._declare, SweepPerplexityTask._declare).
PERPLEXITY_AGGREGATIONS = {
    "ppl": Aggregation("token-weighted perplexity", True, _nll_perplexity),
    "nll": Aggregation("sum", False, _sum),
    "tokens": Aggregation("sum", False, _sum),
    "docs": Aggregation("sum", False, _sum),
}


def lm_eval_aggregation(name: Any) -> Aggregation | None:
    """lm-eval's registered aggregation `name` when it is one recomputed here, else None."""
    if not isinstance(name, str) or name not in NUMBER_AGGREGATIONS + PAIR_AGGREGATIONS:
        return None
    import lm_eval.api.metrics  # noqa: F401  (fills lm-eval's aggregation registry)
    from lm_eval.api.registry import AGGREGATION_REGISTRY

    return Aggregation(name, name in PAIR_AGGREGATIONS, AGGREGATION_REGISTRY.get(name))


def default_aggregation(metric: str) -> Aggregation | None:
    """lm-eval's default aggregation of a metric name (what ConfigurableTask takes when metric_list names
    none: wikitext's word_perplexity -> weighted_perplexity), when it is one recomputed here."""
    import lm_eval.api.metrics  # noqa: F401
    from lm_eval.api.registry import AGGREGATION_REGISTRY, METRIC_AGGREGATION_REGISTRY

    if metric not in METRIC_AGGREGATION_REGISTRY:
        return None
    function = METRIC_AGGREGATION_REGISTRY.get(metric)
    name = next((name for name in NUMBER_AGGREGATIONS + PAIR_AGGREGATIONS
                 if name in AGGREGATION_REGISTRY and AGGREGATION_REGISTRY.get(name) is function), None)
    return lm_eval_aggregation(name)


def _is_perplexity_task(task: str) -> bool:
    from ccq_eval.task_families import PERPLEXITY, UnknownTaskFamilyError, family_of

    try:
        return family_of(task) is PERPLEXITY
    except UnknownTaskFamilyError:
        return False


def metric_aggregations(results: dict[str, Any], task: str) -> dict[str, Aggregation]:
    """The metrics of `task` whose aggregates can be recomputed from per-sample values, with their aggregation
    (module docstring: from metric_list, lm-eval's defaults, or the perplexity tasks' declarations)."""
    config = (results.get("configs") or {}).get(task)
    entries = config.get("metric_list") if isinstance(config, dict) else None
    found: dict[str, Aggregation] = {}
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict) or not isinstance(entry.get("metric"), str):
            continue
        metric = entry["metric"]
        aggregation = (lm_eval_aggregation(entry["aggregation"]) if entry.get("aggregation") is not None
                       else default_aggregation(metric))
        if aggregation is not None:
            found[metric] = aggregation
    if _is_perplexity_task(task):  # the task class's declarations replace any metric_list
        found = {}
        for key in (results.get("results") or {}).get(task) or {}:
            metric = key.partition(",")[0]
            aggregation = _perplexity_aggregation(metric)
            if aggregation is not None:
                found[metric] = aggregation
    return found


def _perplexity_aggregation(metric: str) -> Aggregation | None:
    """How a perplexity task's metric (ppl, ppl@4096, nll@0-2048, doc_ppl@1024, ...) aggregates."""
    base = metric.partition("@")[0]
    if metric.endswith("_stderr"):
        return None
    return lm_eval_aggregation("mean") if base == "doc_ppl" else PERPLEXITY_AGGREGATIONS.get(base)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool included: JSON true / false scores count as 1 / 0


def sample_value(value: Any, pairs: bool) -> Any:
    """A logged per-sample value as an aggregation takes it: a float, or a (value, weight) pair of floats
    when `pairs`; None when it is not of that shape (the metric cannot be recomputed)."""
    if not pairs:
        return float(value) if _is_number(value) else None
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value):
        return float(value[0]), float(value[1])
    return None


def aggregate(values: Sequence[Any], aggregation: str | None) -> float | None:
    """lm-eval's aggregation `aggregation` of logged per-sample values (numbers, or (value, weight) pairs
    for PAIR_AGGREGATIONS); None when it is not one recomputed here or a value is not of its shape."""
    found = lm_eval_aggregation(aggregation)
    return _recompute(found, values) if found is not None and values else None


def _recompute(aggregation: Aggregation, logged: Sequence[Any]) -> float | None:
    values = [sample_value(value, aggregation.pairs) for value in logged]
    if any(value is None for value in values):
        return None
    try:
        return float(aggregation.function(values))
    except (ArithmeticError, ValueError):  # no tokens, an overflowing perplexity: no number to agree with
        return float("nan")


def _shown(stored: float, recomputed: float) -> tuple[str, str]:
    """The two numbers as a message shows them: short, unless that would print them alike."""
    short = f"{stored:g}", f"{recomputed:g}"
    return short if short[0] != short[1] else (repr(float(stored)), repr(float(recomputed)))


@dataclass(frozen=True)
class Recomputed:
    """One aggregate of a results file beside the value its samples give."""

    metric: str
    filter: str
    stored: float
    aggregation: Aggregation
    n_samples: int
    value: float | None  # None: the samples' values are not of the shape the aggregation takes

    @property
    def agrees(self) -> bool:
        if self.value is None:
            return True
        if math.isnan(self.stored) or math.isnan(self.value):
            return math.isnan(self.stored) and math.isnan(self.value)
        return math.isclose(self.stored, self.value, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)


def recompute_task(results: dict[str, Any], task: str, records: list[dict[str, Any]]) -> list[Recomputed]:
    """Every aggregate of `task` in `results` that can be recomputed, with what its samples (`records`, the
    task's samples file) give; n_samples 0 where no sample has a value of the metric."""
    aggregations = metric_aggregations(results, task)
    found = []
    for key, stored in ((results.get("results") or {}).get(task) or {}).items():
        metric, _, filter_name = key.partition(",")
        aggregation = aggregations.get(metric)
        if aggregation is None or isinstance(stored, bool) or not _is_number(stored):
            continue
        logged = [r[metric] for r in records if metric in r and filter_name in ("", r.get("filter", filter_name))]
        value = _recompute(aggregation, logged) if logged else None
        found.append(Recomputed(metric, filter_name, float(stored), aggregation, len(logged), value))
    return found


def check_task(results_path: Path, results: dict[str, Any], task: str, records: list[dict[str, Any]],
               redo: str) -> None:
    """Every aggregate of `task` in `results` that its samples (`records`) decide must be what they give:
    ResultsError naming the file, the metric and both numbers otherwise (`redo` says what to do)."""
    if not records:
        return
    for found in recompute_task(results, task, records):
        if not found.n_samples:
            raise ResultsError(f"{results_path} records {task} {found.metric} = {found.stored:g}, but no sample "
                               f"of the unit has a {found.metric} value (samples from another run?): {redo}")
        if found.value is None or found.agrees:
            continue
        stored, again = _shown(found.stored, found.value)
        raise ResultsError(f"{results_path}: {task} {found.metric} = {stored}, but the {found.aggregation.name} of "
                           f"its {found.n_samples} samples is {again} (edited, or samples swapped from another "
                           f"unit): {redo}")
