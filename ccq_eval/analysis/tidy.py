"""The tidy frame: every result on disk as one row per (model, task, length, depth, bucket, metric).

- rows with length / depth / bucket empty hold the task's overall value from results.json;
- per-length and per-(length, depth) rows are recomputed from the per-sample logs, where the
  documents of S-NIAH, the other RULER tasks and perplexity carry their length and depth, with the
  task's own aggregation (mean, perplexity, weighted_perplexity, bits_per_byte, median);
- metrics named "<metric>@<L>" (perplexity sweep: value at length L) become rows with
  length = L, and "<metric>@<start>-<end>" (position buckets) rows with bucket =
  "start-end" and length = end;
- LongBench-E's per-bucket metrics ("score_0-4k", ...) become rows with bucket set.

`protocol` says how a task's loglikelihood_rolling requests were scored, where the results record it
(scoring_protocol): "hflm" (lm-eval HFLM's disjoint windows) or "carry" (the recurrent state carried
through the whole text); for the recall tasks, the rules they ran under ("jrt, 2048 tokens", "lm-eval");
empty for other tasks.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ccq_eval.harness import store
from ccq_eval.harness.store import ResultsError, StoredUnit, aggregates
from ccq_eval.task_families import DEPTH_KEYS, FAMILIES, LENGTH_KEYS, RECALL, RECALL_LMEVAL_TASKS, family_of
from ccq_eval.tasks.longbench import categories as longbench_categories

TIDY_COLUMNS = [
    "model", "task", "family", "length", "depth", "bucket", "metric", "filter", "value", "n", "stderr",
    "higher_is_better", "primary", "protocol", "source",
]

# Families whose per-length values are recomputed from documents' length / depth (LongBench's
# "length" is a word count; perplexity tasks report per-length metrics themselves).
CELL_FAMILIES = tuple(family.name for family in FAMILIES if family.cell_rows)
_SUFFIX_LENGTH = re.compile(r"^\d+$")
_SUFFIX_RANGE = re.compile(r"^(\d+)-(\d+)$")
_UNDERSCORE_LENGTH = re.compile(r"^(?P<base>.+)_(?P<length>\d+)$")


def split_metric(metric: str, known: Iterable[str] = ()) -> tuple[str, int | None, str | None]:
    """A metric name -> (base metric, length, position bucket).

    'ppl@4096' -> ('ppl', 4096, None); 'ppl@0-512' -> ('ppl', 512, '0-512');
    'acc_1024' -> ('acc', 1024, None) when 'acc' is in `known` (S-NIAH's per-length metrics);
    anything else -> (metric, None, None).
    """
    base, sep, suffix = metric.partition("@")
    if not sep:
        match = _UNDERSCORE_LENGTH.match(metric)
        if match and match["base"] in set(known):
            return match["base"], int(match["length"]), None
        return metric, None, None
    if _SUFFIX_LENGTH.match(suffix):
        return base, int(suffix), None
    match = _SUFFIX_RANGE.match(suffix)
    if match:
        return base, int(match.group(2)), suffix
    return metric, None, None


def primary_metric(task: str, infos: list[MetricInfo]) -> str | None:
    """The metric tables show for `task`: its family's primary metric for it (TaskFamily.primary_metric_for:
    hellaswag's acc_norm, wikitext's word_perplexity) where the task reports it (or says nothing of its
    metrics), else the task's first metric."""
    family_primary = family_of(task).primary_metric_for(task)
    reported = {split_metric(info.name)[0] for info in infos}
    if family_primary is not None and (family_primary in reported or not infos):
        return family_primary
    return split_metric(infos[0].name)[0] if infos else None


PAIRED_AGGREGATIONS = aggregates.PAIR_AGGREGATIONS  # per-sample values are (log-likelihood, count)
# lm-eval's own direction of its built-in metrics, for a metric_list entry that names none (wikitext's
# word_perplexity, ...): lm-eval 0.4.13, lm_eval/api/metrics.py, the register_metric declarations.
LOWER_IS_BETTER_METRICS = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
HIGHER_IS_BETTER_METRICS = ("acc", "acc_norm")
# The names lm-eval registers its HFLM under (lm_eval/models/huggingface.py, @register_model): results of
# those scored loglikelihood_rolling in HFLM's windows.
HFLM_MODEL_NAMES = ("hf", "hf-auto", "huggingface")


def _default_aggregation(metric: str) -> str | None:
    """lm-eval's aggregation of a built-in metric that a config lists without one (store.aggregates)."""
    found = aggregates.default_aggregation(metric)
    return found.name if found is not None else None


def metric_direction(metric: str, stated: bool | None = None) -> bool | None:
    """Whether a higher value of `metric` is better: as the results state it, else lower for lm-eval's
    perplexities and higher for its accuracies, else None."""
    if stated is not None:
        return bool(stated)
    if metric in LOWER_IS_BETTER_METRICS:
        return False
    return True if metric in HIGHER_IS_BETTER_METRICS else None


def recall_protocol(unit: StoredUnit, task: str) -> str | None:
    """The rules a recall task ran under: "lm-eval" for lm-eval's own swde / fda / squad_completion, "jrt,
    <L> tokens" (", read twice" added for the read-twice prompt) for ours, read from the task's metadata as
    the results record it; None for other tasks."""
    if family_of(task) is not RECALL:
        return None
    if task in RECALL_LMEVAL_TASKS:
        return "lm-eval"
    metadata = ((unit.results.get("configs") or {}).get(task) or {}).get("metadata") or {}
    label = f"jrt, {metadata.get('recall_length', 2048)} tokens"
    return label + (", read twice" if metadata.get("recall_prompt") == "twice" else "")


def scoring_protocol(unit: StoredUnit, task: str) -> str | None:
    """How `task`'s loglikelihood_rolling requests were scored: "hflm" or "carry" as ccq-eval's adapter
    records it per task (results["config"]["ccq_scoring"]["rolling_protocol_by_task"]), "hflm" for a
    rolling task of lm-eval's own HFLM; for a recall task its rules (recall_protocol); None for any other
    task and results that do not say."""
    if family_of(task) is RECALL:
        return recall_protocol(unit, task)
    config = unit.results.get("config") or {}
    scoring = config.get("ccq_scoring") if isinstance(config.get("ccq_scoring"), dict) else {}
    by_task = scoring.get("rolling_protocol_by_task") or {}
    if task in by_task:
        return str(by_task[task])
    task_config = (unit.results.get("configs") or {}).get(task) or {}
    if task_config.get("output_type") == "loglikelihood_rolling" and config.get("model") in HFLM_MODEL_NAMES:
        return "hflm"
    return None


def task_family(task: str) -> str:
    """The name of `task`'s family (ccq_eval.task_families), the tidy frame's `family` column."""
    return family_of(task).name


# --------------------------------------------------------------------------------------------
# LongBench datasets and categories (ccq_eval.tasks.longbench.categories)


def longbench_dataset(task: str) -> str | None:
    """'ccq_longbench_e_qasper' -> 'qasper'; None for a task outside LongBench."""
    parsed = longbench_categories.dataset_of_task(task)
    return parsed[0] if parsed else None


# --------------------------------------------------------------------------------------------
# Reading one task of one unit


@dataclass
class MetricInfo:
    name: str
    aggregation: str | None  # None when the task aggregates with its own function
    higher_is_better: bool | None


def metric_infos(unit: StoredUnit, task: str) -> list[MetricInfo]:
    """The task's metrics in metric_list order, with aggregation and direction."""
    config = (unit.results.get("configs") or {}).get(task) or {}
    direction = (unit.results.get("higher_is_better") or {}).get(task) or {}
    infos = []
    for entry in config.get("metric_list") or []:
        if not isinstance(entry, dict) or "metric" not in entry:
            continue
        aggregation = entry.get("aggregation", _default_aggregation(str(entry["metric"])))
        known = aggregation in ("mean", "median", "perplexity", *PAIRED_AGGREGATIONS)
        infos.append(MetricInfo(
            name=str(entry["metric"]),
            aggregation=aggregation if known else None,
            higher_is_better=metric_direction(str(entry["metric"]),
                                              direction.get(entry["metric"], entry.get("higher_is_better"))),
        ))
    if not infos:  # results without configs: fall back to the metric keys
        for key in (unit.task_results.get(task) or {}):
            metric, _, _ = key.partition(",")
            if "," in key and not metric.endswith("_stderr") and metric not in [i.name for i in infos]:
                infos.append(MetricInfo(metric, _default_aggregation(metric),
                                        metric_direction(metric, direction.get(metric))))
    return infos


def aggregate(values: Sequence[Any], aggregation: str | None) -> float | None:
    """lm-eval's aggregation of per-sample metric values (None when it cannot be recomputed): the store's
    recomputation (store.aggregates), which every reader also checks results.json's aggregates with."""
    return aggregates.aggregate(values, aggregation)


def doc_cell(doc: Any) -> tuple[float | None, float | None]:
    """(length, depth) a document names under LENGTH_KEYS / DEPTH_KEYS (None for what it lacks)."""
    if not isinstance(doc, dict):
        return None, None
    length = next((doc[k] for k in LENGTH_KEYS if doc.get(k) is not None), None)
    depth = next((doc[k] for k in DEPTH_KEYS if doc.get(k) is not None), None)
    return (_number(length), _number(depth))


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool included: JSON true/false scores count as 1/0


def stored_value(value: Any) -> Any:
    """A per-sample metric value as aggregate() takes it, or None when it is not numeric."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value):
        return (float(value[0]), float(value[1]))
    return None


# --------------------------------------------------------------------------------------------
# The tidy frame


def _row(**fields: Any) -> dict[str, Any]:
    row = {column: None for column in TIDY_COLUMNS}
    row.update(fields)
    return row


def _overall_rows(unit: StoredUnit, task: str, infos: list[MetricInfo]) -> list[dict[str, Any]]:
    values = unit.task_results.get(task) or {}
    n_samples = (unit.results.get("n-samples") or {}).get(task) or {}
    n_total = n_samples.get("effective", values.get("sample_len"))
    family = task_family(task)
    primary = primary_metric(task, infos)
    direction = {info.name: info.higher_is_better for info in infos}
    direction.update((unit.results.get("higher_is_better") or {}).get(task) or {})
    known = {key.partition(",")[0] for key in values if "," in key}
    filters = [key.partition(",")[2] for key in values if "," in key]
    first_filter = "none" if "none" in filters or not filters else filters[0]
    protocol = scoring_protocol(unit, task)
    rows = []
    for key, value in values.items():
        metric, sep, filter_name = key.partition(",")
        if not sep or metric.endswith("_stderr") or not _is_number(value):
            continue
        stderr = values.get(f"{metric}_stderr,{filter_name}")
        base_metric, length, bucket = split_metric(metric, known)
        n = n_total
        if length is not None and bucket is None:
            # per-length metric: its own document count when the task reports one (docs@L)
            docs = values.get(f"docs@{length},{filter_name}")
            n = docs if _is_number(docs) else None
        if family_of(task).bucket_metrics and "_" in metric and length is None:
            head, _, tail = metric.rpartition("_")
            if head in direction and tail and tail[0].isdigit():
                base_metric, bucket, n = head, tail, None
        rows.append(_row(
            model=unit.model, task=task, family=family, length=length, bucket=bucket, metric=base_metric,
            filter=filter_name, value=float(value), n=n, stderr=float(stderr) if _is_number(stderr) else None,
            higher_is_better=metric_direction(base_metric, direction.get(metric, direction.get(base_metric))),
            primary=base_metric == primary and filter_name == first_filter, protocol=protocol,
            source=str(unit.results_path),
        ))
    return rows


def _cell_rows(unit: StoredUnit, task: str, infos: list[MetricInfo], samples: list[dict]) -> list[dict]:
    """Per-length and per-(length, depth) values recomputed from the sample log."""
    family = task_family(task)
    primary = primary_metric(task, infos)
    names = {info.name for info in infos}
    # acc_1024 and the like already are per-length variants of acc: recompute only the bases
    infos = [info for info in infos if split_metric(info.name, names)[1] is None]
    # lm-eval logs one sample per (doc, filter); per-cell values use the first filter's samples
    sample_filter = samples[0].get("filter", "none") if samples else "none"
    samples = [s for s in samples if s.get("filter", "none") == sample_filter]
    by_length: dict[tuple[str, float], list[Any]] = defaultdict(list)
    by_cell: dict[tuple[str, float, float], list[Any]] = defaultdict(list)
    for sample in samples:
        length, depth = doc_cell(sample.get("doc"))
        if length is None:
            continue
        for info in infos:
            value = stored_value(sample.get(info.name))
            if value is None:
                continue
            by_length[(info.name, length)].append(value)
            if depth is not None:
                by_cell[(info.name, length, depth)].append(value)
    aggregation = {info.name: info.aggregation for info in infos}
    direction = {info.name: info.higher_is_better for info in infos}
    rows = []
    groups: list[tuple[str, float, float | None, list[Any]]] = [
        (metric, length, None, values) for (metric, length), values in by_length.items()
    ] + [(metric, length, depth, values) for (metric, length, depth), values in by_cell.items()]
    for metric, length, depth, values in groups:
        value = aggregate(values, aggregation[metric])
        if value is None:
            continue
        rows.append(_row(
            model=unit.model, task=task, family=family, length=length, depth=depth, metric=metric,
            filter=sample_filter, value=value, n=len(values), higher_is_better=direction[metric],
            primary=metric == primary, protocol=scoring_protocol(unit, task), source=str(unit.results_path),
        ))
    return rows


def tidy_table(units: Iterable[StoredUnit]) -> pd.DataFrame:
    """All results as one tidy frame (see the module docstring for the rows it holds)."""
    rows: list[dict[str, Any]] = []
    for unit in units:
        for task in unit.leaf_tasks():
            infos = metric_infos(unit, task)
            overall = _overall_rows(unit, task, infos)
            rows.extend(overall)
            if family_of(task).cell_rows:
                cells = _cell_rows(unit, task, infos, unit.samples(task))
                recomputed = {(r["length"], r["metric"], r["filter"]): r for r in cells if r["depth"] is None}
                for row in overall:
                    twin = recomputed.pop((row["length"], row["metric"], row["filter"]), None)
                    if twin is not None and row["n"] is None:
                        row["n"] = twin["n"]  # results.json's value, the sample log's count
                # results.json's own per-length values win over the recomputed ones (they agree)
                rows.extend(r for r in cells if r["depth"] is not None or r in recomputed.values())
    frame = pd.DataFrame(rows, columns=TIDY_COLUMNS)
    frame["length"] = pd.to_numeric(frame["length"]).astype("Int64")
    frame["depth"] = pd.to_numeric(frame["depth"]).astype("Float64")
    frame["n"] = pd.to_numeric(frame["n"]).astype("Int64")
    frame["value"] = pd.to_numeric(frame["value"]).astype(float)
    _check_duplicates(frame)
    return frame.sort_values(["family", "task", "model", "metric", "length", "depth", "bucket"],
                             na_position="first", kind="stable").reset_index(drop=True)


def _check_duplicates(frame: pd.DataFrame) -> None:
    keys = ["model", "task", "length", "depth", "bucket", "metric", "filter"]
    duplicated = frame[frame.duplicated(keys, keep=False)]
    if duplicated.empty:
        return
    first = duplicated.iloc[0]
    same = duplicated[(duplicated["model"] == first["model"]) & (duplicated["task"] == first["task"])]
    sources = sorted(set(same["source"]))
    raise ResultsError(
        f"model {first['model']!r} has results for task {first['task']!r} in more than one file: "
        f"{', '.join(sources)}. Point the command at one run's folder, or move one of them away."
    )


def load_tidy(root: Path) -> pd.DataFrame:
    return tidy_table(store.load_results(root))
