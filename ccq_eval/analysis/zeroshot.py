"""The zero-shot suite in the layout of the GLA and Gated DeltaNet papers' main table (`ccq-eval table`).

    zeroshot_pivot(tidy)        -> model x the papers' columns and "Avg.", its note in frame.attrs["note"]
    paper_header(task, metric)  -> "LMB. ppl", ... (None for a metric the papers do not show)
    accuracy_columns(frame)     -> the columns of such a frame that hold accuracies in %, then "Avg."

Columns: task_families.ZEROSHOT_PAPER_COLUMNS that any model has, in that order, with their headers.
Accuracies (acc, acc_norm) are in percent, as the papers print them; perplexities are lm-eval's numbers.
"Avg." is the mean of the ZEROSHOT_AVERAGED accuracies, shown only for a model that has every one of them.

A rolling task's perplexity (wikitext) depends on how its texts were scored: in lm-eval HFLM's disjoint
windows, each read afresh (the papers' protocol), or in one pass that carries the recurrent state. The
tidy frame's `protocol` column says which (ccq_eval.analysis.tidy.scoring_protocol); the column header
names it, and models scored by different protocols get a column each, never one column together.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from ccq_eval.analysis.formatting import failed_label
from ccq_eval.task_families import ZEROSHOT, ZEROSHOT_AVERAGED, ZEROSHOT_PAPER_COLUMNS, TaskFamily

AVERAGE_HEADER = "Avg."
PERCENT_METRICS = ("acc", "acc_norm")
# Metrics only loglikelihood_rolling tasks report: their columns always say the protocol.
ROLLING_METRICS = ("word_perplexity", "byte_perplexity", "bits_per_byte")
PROTOCOL_LABELS = {"hflm": "HFLM windows", "carry": "state carried"}
PROTOCOL_DESCRIPTIONS = {
    "hflm": "lm-eval HFLM's disjoint windows of the model's max length, each read from an empty state, as the "
            "papers score it",
    "carry": "one pass over each text, the recurrent state carried from window to window",
}
UNRECORDED = "protocol not recorded"
_HEADERS = {(task, metric): header for task, metric, header in ZEROSHOT_PAPER_COLUMNS}


def paper_header(task: str, metric: str) -> str | None:
    """The papers' column header of `metric` of `task` ("Hella. acc_n"), None when they show no such column."""
    return _HEADERS.get((task, metric))


def protocol_label(protocol: Any) -> str:
    """'HFLM windows', 'state carried', or the recorded name; UNRECORDED when the results do not say."""
    if protocol is None or (isinstance(protocol, float) and math.isnan(protocol)) or protocol is pd.NA:
        return UNRECORDED
    return PROTOCOL_LABELS.get(str(protocol), str(protocol))


def _overall_values(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame:
    """The family's overall values (no length, no bucket), one per (model, task, metric): lm-eval's "none"
    filter where the task has it, else its first."""
    rows = tidy[(tidy["family"] == family.name) & tidy["length"].isna() & tidy["bucket"].isna()]
    rows = rows.assign(_unfiltered=rows["filter"].isin(["none"]) | rows["filter"].isna())
    rows = rows.sort_values("_unfiltered", ascending=False, kind="stable")
    return rows.drop_duplicates(["model", "task", "metric"]).drop(columns="_unfiltered")


def _shown(value: float, metric: str) -> float | str:
    """A value as the table shows it: accuracies in %, a non-finite value as failed."""
    if not math.isfinite(value):
        return failed_label(value)
    return 100 * value if metric in PERCENT_METRICS else value


def _protocol_order(label: str) -> tuple[int, str]:
    labels = list(PROTOCOL_LABELS.values())
    return (labels.index(label) if label in labels else len(labels) + (label == UNRECORDED), label)


def _columns(values: pd.DataFrame) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """header -> {model: shown value} for each paper column with values, and the protocol labels of the
    rolling columns (a column per protocol: models scored differently never share one)."""
    columns: dict[str, dict[str, Any]] = {}
    protocols: list[str] = []
    for task, metric, header in ZEROSHOT_PAPER_COLUMNS:
        cells = values[(values["task"] == task) & (values["metric"] == metric)]
        if cells.empty:
            continue
        labels = [protocol_label(p) for p in cells["protocol"]]
        rolling = metric in ROLLING_METRICS or any(label != UNRECORDED for label in labels)
        if not rolling:
            columns[header] = {m: _shown(v, metric) for m, v in zip(cells["model"], cells["value"])}
            continue
        for label in sorted(set(labels), key=_protocol_order):
            chosen = [lab == label for lab in labels]
            columns[f"{header} ({label})"] = {m: _shown(v, metric) for m, v in
                                              zip(cells["model"][chosen], cells["value"][chosen])}
            protocols.append(label)
    return columns, list(dict.fromkeys(protocols))


def _averages(values: pd.DataFrame, models: list[str]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """model -> Avg. (the mean of ZEROSHOT_AVERAGED in %, failed when one of them failed) for the models with
    every averaged value, and model -> the headers it lacks for the others."""
    averages, lacking = {}, {}
    for model in models:
        own = values[values["model"] == model]
        found = {(t, m): float(v) for t, m, v in zip(own["task"], own["metric"], own["value"])}
        missing = [_HEADERS[key] for key in ZEROSHOT_AVERAGED if key not in found]
        if missing:
            lacking[model] = missing
            continue
        picked = [found[key] for key in ZEROSHOT_AVERAGED]
        mean = math.fsum(picked) / len(picked)
        averages[model] = 100 * mean if math.isfinite(mean) else failed_label(math.nan)
    return averages, lacking


def zeroshot_note(protocols: list[str], lacking: dict[str, list[str]]) -> str:
    """How to read the table: units, the protocols of its rolling columns, what Avg. covers and where it is
    missing."""
    parts = ["accuracy in % (acc_n: lm-eval's acc_norm, normalised by the answer's length); perplexity as "
             "lm-eval reports it (Wiki.: per word, LMB.: of the last word), lower is better"]
    for label in protocols:
        protocol = next((key for key, value in PROTOCOL_LABELS.items() if value == label), None)
        detail = PROTOCOL_DESCRIPTIONS.get(protocol, "the results do not record how the texts were scored")
        parts.append(f"{label}: {detail}")
    if len(protocols) > 1:
        parts.append("models scored with different protocols are in separate columns")
    averaged = ", ".join(_HEADERS[key] for key in ZEROSHOT_AVERAGED)
    average = f"{AVERAGE_HEADER}: mean of the {len(ZEROSHOT_AVERAGED)} accuracy columns {averaged}"
    if lacking:
        reasons = "; ".join(f"{model} lacks {', '.join(headers)}" for model, headers in sorted(lacking.items()))
        average += f" ('-' for a model without all of them: {reasons})"
    parts.append(average)
    return "; ".join(parts)


def zeroshot_pivot(tidy: pd.DataFrame, family: TaskFamily = ZEROSHOT) -> pd.DataFrame | None:
    """model x the papers' columns with values, then Avg.; failed (non-finite) values shown as failed. The
    note (zeroshot_note) is in the frame's attrs["note"]. None when no model has a paper column."""
    values = _overall_values(tidy, family)
    columns, protocols = _columns(values)
    if not columns:
        return None
    models = sorted({model for cells in columns.values() for model in cells})
    averages, lacking = _averages(values, models)
    columns[AVERAGE_HEADER] = averages
    frame = pd.DataFrame({header: [cells.get(model, math.nan) for model in models]
                          for header, cells in columns.items()}, index=pd.Index(models, name="model"), dtype=object)
    frame.attrs["note"] = zeroshot_note(protocols, lacking)
    return frame


def accuracy_columns(frame: pd.DataFrame) -> list[str]:
    """The columns of a zeroshot_pivot frame that hold accuracies in %, in order, then Avg. when it has one."""
    accuracy = {header for _, metric, header in ZEROSHOT_PAPER_COLUMNS if metric in PERCENT_METRICS}
    shown = [column for column in frame.columns if column in accuracy]
    has_average = AVERAGE_HEADER in frame.columns and frame[AVERAGE_HEADER].map(
        lambda v: isinstance(v, float) and math.isfinite(v)).any()
    return shown + ([AVERAGE_HEADER] if has_average else [])
