"""Tidy tables from results on disk, and the pivots papers print.

The tidy frame has one row per (model, task, length, depth, bucket, metric):

- rows with length / depth / bucket empty hold the task's overall value from results.json;
- per-length and per-(length, depth) rows are recomputed from the per-sample logs, where
  S-NIAH and perplexity documents carry their length and depth, with the task's own
  aggregation (mean, perplexity, weighted_perplexity, bits_per_byte, median);
- metrics named "<metric>@<L>" (perplexity sweep: value at length L) become rows with
  length = L, and "<metric>@<start>-<end>" (position buckets) rows with bucket =
  "start-end" and length = end;
- LongBench-E's per-bucket metrics ("score_0-4k", ...) become rows with bucket set.

Pivots: S-NIAH accuracy per length, perplexity per length, LongBench per dataset with
category averages, and a catch-all of overall values for any other lm-eval task.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ccq_eval.analysis.sweeps import (  # noqa: F401  (re-exported: the sweeps are read with the tables)
    ccq_attachment,
    ccq_sweep_points,
    sweep_attachments,
    sweep_points,
)
from ccq_eval.harness import results_store
from ccq_eval.harness.results_store import ResultsError, StoredUnit
from ccq_eval.task_families import DEPTH_KEYS, FAMILIES, LENGTH_KEYS, OUR_TASK_PREFIX, TaskFamily, family_of
from ccq_eval.tasks.longbench import categories as longbench_categories

TIDY_COLUMNS = [
    "model", "task", "family", "length", "depth", "bucket", "metric", "filter", "value", "n", "stderr",
    "higher_is_better", "primary", "source",
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
    """The metric tables show for `task`: its family's primary metric where the task reports it (or says
    nothing of its metrics), else the task's first metric."""
    family_primary = family_of(task).primary_metric
    reported = {split_metric(info.name)[0] for info in infos}
    if family_primary is not None and (family_primary in reported or not infos):
        return family_primary
    return split_metric(infos[0].name)[0] if infos else None

PAIRED_AGGREGATIONS = ("weighted_perplexity", "bits_per_byte")


def task_family(task: str) -> str:
    """The name of `task`'s family (ccq_eval.task_families), the tidy frame's `family` column."""
    return family_of(task).name


def display_task(task: str) -> str:
    """'ccq_s_niah_1' -> 'S-NIAH-1', 'ccq_longbench_e_qasper' -> 'LongBench-E qasper', 'ccq_ppl_sweep'
    -> 'ppl_sweep' (a family prefix and "_" become its display_label); other names unchanged."""
    for prefix, label in _DISPLAY_PREFIXES:
        if task.startswith(prefix):
            return label + task.removeprefix(prefix)
    return task.removeprefix(OUR_TASK_PREFIX)


# (family prefix + "_", its display label), longest first
_DISPLAY_PREFIXES = sorted(((prefix + "_", family.display_label) for family in FAMILIES if family.display_label
                            for prefix in family.task_prefixes), key=lambda pair: -len(pair[0]))


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
        aggregation = entry.get("aggregation")
        known = aggregation in ("mean", "median", "perplexity", *PAIRED_AGGREGATIONS)
        infos.append(MetricInfo(
            name=str(entry["metric"]),
            aggregation=aggregation if known else None,
            higher_is_better=direction.get(entry["metric"], entry.get("higher_is_better")),
        ))
    if not infos:  # results without configs: fall back to the metric keys
        for key in (unit.task_results.get(task) or {}):
            metric, _, _ = key.partition(",")
            if "," in key and not metric.endswith("_stderr") and metric not in [i.name for i in infos]:
                infos.append(MetricInfo(metric, None, direction.get(metric)))
    return infos


def aggregate(values: Sequence[Any], aggregation: str | None) -> float | None:
    """lm-eval's aggregation of per-sample metric values (None when it cannot be recomputed)."""
    if not values or aggregation is None:
        return None
    if aggregation == "mean":
        return math.fsum(float(v) for v in values) / len(values)
    if aggregation == "median":
        return float(pd.Series([float(v) for v in values]).median())
    if aggregation == "perplexity":  # values are log-likelihoods
        return math.exp(-math.fsum(float(v) for v in values) / len(values))
    if aggregation in PAIRED_AGGREGATIONS:  # values are (log-likelihood, count)
        total_ll = math.fsum(float(v[0]) for v in values)
        total_n = math.fsum(float(v[1]) for v in values)
        if aggregation == "weighted_perplexity":
            return math.exp(-total_ll / total_n)
        return -total_ll / total_n / math.log(2)
    return None


def doc_cell(doc: Any) -> tuple[float | None, float | None]:
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


def _stored_value(value: Any) -> Any:
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
            higher_is_better=direction.get(metric, direction.get(base_metric)),
            primary=base_metric == primary and filter_name == first_filter, source=str(unit.results_path),
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
            value = _stored_value(sample.get(info.name))
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
            primary=metric == primary, source=str(unit.results_path),
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
    return tidy_table(results_store.load_results(root))


# --------------------------------------------------------------------------------------------
# Pivots


@dataclass
class Pivot:
    title: str
    frame: pd.DataFrame
    note: str = ""


def _length_label(length: Any) -> str:
    length = int(length)
    if length % 1024 == 0:
        return f"{length // 1024}K"
    return str(length)


def _length_pivot(rows: pd.DataFrame) -> pd.DataFrame:
    pivot = rows.pivot_table(index=["task", "model"], columns="length", values="value", aggfunc="first")
    pivot = pivot.reindex(sorted(pivot.columns), axis=1)
    pivot.columns = [_length_label(c) for c in pivot.columns]
    pivot = pivot.rename(index=display_task, level="task")
    return pivot


def _family_rows(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame:
    return tidy[tidy["family"] == family.name]


def length_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """task x model x length of a family's primary metric (S-NIAH accuracy, sweep perplexity)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["length"].notna() & rows["depth"].isna() & rows["bucket"].isna()]
    return None if rows.empty else _length_pivot(rows)


def position_bucket_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """task x model x end of the position bucket, of a family's primary metric (bucketed perplexity)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["bucket"].notna()]
    return None if rows.empty else _length_pivot(rows)


def longbench_pivot(tidy: pd.DataFrame, family: str = "longbench") -> pd.DataFrame | None:
    """model x dataset (official order) with category averages and the mean of categories."""
    rows = tidy[(tidy["family"] == family) & tidy["primary"] & tidy["length"].isna() & tidy["bucket"].isna()]
    if rows.empty:
        return None
    scores: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows.itertuples():
        dataset = longbench_dataset(row.task)
        if dataset is not None:
            scores[row.model][dataset] = float(row.value)
    if not scores:
        return None
    present = [d for d in longbench_categories.DATASET_CATEGORY if any(d in s for s in scores.values())]
    table: dict[str, dict[str, float]] = {}
    for model, per_dataset in scores.items():
        line = {dataset: per_dataset.get(dataset, math.nan) for dataset in present}
        averages = longbench_categories.category_averages(per_dataset, language="all")
        for slug, label in longbench_categories.CATEGORY_LABELS.items():
            if slug in averages:
                line[f"{label} avg"] = averages[slug]
        if averages:
            line["Avg (categories)"] = sum(averages.values()) / len(averages)
        table[model] = line
    frame = pd.DataFrame.from_dict(table, orient="index")
    frame.index.name = "model"
    return frame.sort_index()


def length_bucket_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """dataset x model x length bucket (LongBench-E's score_0-4k, ...)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["bucket"].notna()]
    if rows.empty:
        return None
    rows = rows.assign(dataset=[longbench_dataset(t) or t for t in rows["task"]])
    return rows.pivot_table(index=["dataset", "model"], columns="bucket", values="value", aggfunc="first")


def overall_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """model x (task, metric) of the overall values (any other lm-eval task)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["length"].isna()]
    if rows.empty:
        return None
    label = rows["task"] + " " + rows["metric"]
    rows = rows.assign(column=label.where(rows["filter"].isin(["none", None]), label + " (" + rows["filter"] + ")"))
    return rows.pivot_table(index="model", columns="column", values="value", aggfunc="first")


# --------------------------------------------------------------------------------------------
# Non-finite values: an evaluation that gave NaN or inf (a NaN weight, a lambda the model cannot take)
# failed there; tables show such a value as failed, they never drop it.

NON_FINITE_NOTE = ("NaN / inf (failed): the evaluation gave a non-finite value; `ccq-eval run` counts such a "
                   "unit as failed")


def failed_label(value: float) -> str:
    """How tables show a non-finite value: 'NaN (failed)', 'inf (failed)' or '-inf (failed)'."""
    return ("NaN" if math.isnan(value) else f"{value:g}") + " (failed)"


def with_failures_shown(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with each non-finite value replaced by its failed_label (the column becomes object)."""
    return rows.assign(value=pd.Series([v if math.isfinite(v) else failed_label(v) for v in rows["value"]],
                                       index=rows.index, dtype=object))


def has_failures(frame: pd.DataFrame) -> bool:
    return any(isinstance(v, str) and v.endswith(" (failed)") for v in frame.to_numpy().ravel())


def longbench_shown(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """longbench_pivot with a model's failed datasets, and the averages over them, shown as failed."""
    frame = longbench_pivot(tidy, family.name)
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["length"].isna() & rows["bucket"].isna()]
    failed = rows[~rows["value"].map(math.isfinite)]
    if frame is None or failed.empty:
        return frame
    datasets = {longbench_dataset(task) for task in rows["task"]}
    shown = frame.astype(object)
    for model, task, value in failed[["model", "task", "value"]].itertuples(index=False):
        for column in shown.columns:
            cell = shown.at[model, column]
            average_over_it = column not in datasets and isinstance(cell, float) and math.isnan(cell)
            if column == longbench_dataset(task) or average_over_it:
                shown.at[model, column] = failed_label(value)
    return shown


# FamilyTable.pivot -> (the pivot, whether it reads the tidy frame with failures already shown).
# longbench_pivot averages over datasets, so it reads the numbers and marks failures itself.
PIVOTS: dict[str, tuple[Callable[[pd.DataFrame, TaskFamily], pd.DataFrame | None], bool]] = {
    "per_length": (length_pivot, True),
    "per_position_bucket": (position_bucket_pivot, True),
    "longbench_categories": (longbench_shown, False),
    "per_length_bucket": (length_bucket_pivot, True),
    "overall": (overall_pivot, True),
}


def paper_pivots(tidy: pd.DataFrame) -> list[Pivot]:
    """The tables every family's entry names (task_families.FAMILIES), in that order, those with rows."""
    pivots = []
    shown = with_failures_shown(tidy)
    for family in FAMILIES:
        for table in family.tables:
            make_pivot, reads_shown = PIVOTS[table.pivot]
            frame = make_pivot(shown if reads_shown else tidy, family)
            if frame is not None and not frame.empty:
                note = table.note
                if has_failures(frame):
                    note = f"{note}; {NON_FINITE_NOTE}" if note else NON_FINITE_NOTE
                pivots.append(Pivot(table.title, frame, note))
    return pivots


# --------------------------------------------------------------------------------------------
# Rendering: LaTeX through pandas' Styler; markdown by hand, because pytablewriter and tabulate pad
# every cell to its column's width, which would change every committed table.md.


def _format_cell(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _flat(frame: pd.DataFrame) -> tuple[list[str], list[list[Any]]]:
    flat = frame.reset_index() if any(name is not None for name in frame.index.names) else frame
    headers = [str(c) for c in flat.columns]
    return headers, flat.astype(object).values.tolist()


_MARKDOWN_SPECIAL = {"\\": "\\\\", "|": "\\|", "<": "&lt;", ">": "&gt;", "&": "&amp;", "\n": " ", "\r": " "}


def markdown_escape(text: str) -> str:
    """`text` as literal markdown table text: a `|` in a model folder named `gla|100.00` must not start
    a cell, and raw HTML in a name must not become markup."""
    return "".join(_MARKDOWN_SPECIAL.get(ch, ch) for ch in text)


def to_markdown(frame: pd.DataFrame, digits: int = 2) -> str:
    headers, body = _flat(frame)
    lines = ["| " + " | ".join(markdown_escape(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    for row in body:
        lines.append("| " + " | ".join(markdown_escape(_format_cell(v, digits)) for v in row) + " |")
    return "\n".join(lines)


_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def _latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def to_latex(frame: pd.DataFrame, digits: int = 2, caption: str = "") -> str:
    """A booktabs table (pandas Styler.to_latex): index columns left-aligned, values right-aligned."""
    flat = frame.reset_index() if any(name is not None for name in frame.index.names) else frame
    styler = (flat.style.format(precision=digits, na_rep="-", escape="latex")
              .format_index(escape="latex", axis=1).hide(axis="index"))
    return styler.to_latex(
        hrules=True, position="t", position_float="centering",
        caption=_latex_escape(caption) if caption else None,  # the Styler leaves captions unescaped
        column_format="l" * (flat.shape[1] - frame.shape[1]) + "r" * frame.shape[1],
    ).rstrip("\n")


def to_csv(frame: pd.DataFrame) -> str:
    flat = frame.reset_index() if any(name is not None for name in frame.index.names) else frame
    return flat.to_csv(index=False)


FORMATS = ("markdown", "csv", "latex")


def render_tables(tidy: pd.DataFrame, fmt: str = "markdown", view: str = "paper", digits: int = 2) -> str:
    """The tidy frame (view="tidy") or the paper pivots (view="paper") as markdown, csv or LaTeX."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if view == "tidy":
        frame = with_failures_shown(tidy.drop(columns=["source"]))
        if fmt != "csv":
            frame = frame.drop(columns=["family", "primary", "higher_is_better"])
        if fmt == "csv":
            return frame.to_csv(index=False)
        if fmt == "latex":
            return to_latex(frame, digits, "All results") + "\n"
        return to_markdown(frame, digits) + (f"\n\n_{NON_FINITE_NOTE}_" if has_failures(frame) else "") + "\n"
    if view != "paper":
        raise ValueError(f"unknown view {view!r}; valid: paper, tidy")
    pivots = paper_pivots(tidy)
    parts = []
    for pivot in pivots:
        if fmt == "markdown":
            parts.append(f"### {pivot.title}\n\n" + to_markdown(pivot.frame, digits)
                         + (f"\n\n_{pivot.note}_" if pivot.note else ""))
        elif fmt == "latex":
            parts.append(to_latex(pivot.frame, digits, pivot.title))
        else:
            parts.append(f"# {pivot.title}\n" + to_csv(pivot.frame).rstrip("\n"))
    return "\n\n".join(parts) + "\n"
