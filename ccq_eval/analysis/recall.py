"""The recall-intensive tasks in the layout of the Based / JRT papers' table (`ccq-eval table --view recall`).

    recall_pivot(tidy)   -> model x SWDE, SQD, FDA, TQA, NQ, DROP, Avg. (its note in frame.attrs["note"])
    recall_columns(frame) -> the columns of such a frame that hold accuracies in %, Avg. included

Columns: task_families.RECALL_PAPER_COLUMNS that any model has, in that order; a value is the task's
`contains` in percent (the share of documents whose output holds a label). Avg. is the mean of the six, shown
for a model that has all six.

The rules a task ran under (the tidy frame's `protocol`: "jrt, 2048 tokens", "jrt, 1024 tokens, read twice",
"lm-eval") change its numbers, so units run under different rules never share a column: with one set of rules
in the results the headers are the papers' and the note names the rules; with several, every header names its
rules and each set has its own Avg.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from ccq_eval.analysis.formatting import failed_label
from ccq_eval.task_families import RECALL, RECALL_PAPER_COLUMNS, TaskFamily

AVERAGE_HEADER = "Avg."
UNRECORDED = "rules not recorded"
_HEADERS = [header for _, _, header in RECALL_PAPER_COLUMNS]
RULES_DESCRIPTIONS = {
    "jrt": "jrt: the JRT harness's rules (each document cut to the length, in the model's tokens, around its "
           "answer; the reference's per-task prompts; greedy, at most 48 tokens, stop at a newline)",
    "lm-eval": "lm-eval: lm-eval's own swde, fda and squad_completion (uncut, stripped prompt and label)",
}


def _header_of(task: str) -> str | None:
    for ours, lmeval, header in RECALL_PAPER_COLUMNS:
        if task in (ours, lmeval):
            return header
    return None


def _shown(value: float) -> float | str:
    return 100 * value if math.isfinite(value) else failed_label(value)


def _values(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame:
    """Each (model, task)'s overall contains, with its rules and its paper header."""
    rows = tidy[(tidy["family"] == family.name) & (tidy["metric"] == "contains") & tidy["length"].isna()
                & tidy["bucket"].isna()]
    rows = rows.drop_duplicates(["model", "task"])
    rules = [protocol if isinstance(protocol, str) and protocol else UNRECORDED for protocol in rows["protocol"]]
    return rows.assign(rules=rules, header=[_header_of(task) for task in rows["task"]])


def _rules_order(label: str) -> tuple[int, int, str]:
    """jrt rules first (by length), then lm-eval, then unrecorded."""
    if label.startswith("jrt"):
        digits = "".join(ch for ch in label.split(",")[1] if ch.isdigit()) if "," in label else ""
        return (0, int(digits or 0), label)
    return (1 if label == "lm-eval" else 2, 0, label)


def recall_pivot(tidy: pd.DataFrame, family: TaskFamily = RECALL) -> pd.DataFrame | None:
    """model x the papers' columns (per set of rules when the results hold several), then Avg.; failed values
    shown as failed. The note is in the frame's attrs["note"]. None when no model has a recall task."""
    values = _values(tidy, family)
    values = values[values["header"].notna()]
    if values.empty:
        return None
    rule_sets = sorted(set(values["rules"]), key=_rules_order)
    models = sorted(set(values["model"]))
    columns: dict[str, dict[str, Any]] = {}
    lacking: dict[str, list[str]] = {}
    for rules in rule_sets:
        chosen = values[values["rules"] == rules]
        suffix = f" ({rules})" if len(rule_sets) > 1 else ""
        for header in _HEADERS:
            cells = chosen[chosen["header"] == header]
            if not cells.empty:
                columns[header + suffix] = {m: _shown(v) for m, v in zip(cells["model"], cells["value"])}
        averages = {}
        for model in sorted(set(chosen["model"])):
            own = chosen[chosen["model"] == model]
            found = dict(zip(own["header"], own["value"].astype(float)))
            missing = [header for header in _HEADERS if header not in found]
            if missing:
                lacking[model + suffix] = missing
                continue
            mean = math.fsum(found[header] for header in _HEADERS) / len(_HEADERS)
            averages[model] = 100 * mean if math.isfinite(mean) else failed_label(math.nan)
        columns[AVERAGE_HEADER + suffix] = averages
    frame = pd.DataFrame({header: [cells.get(model, math.nan) for model in models]
                          for header, cells in columns.items()}, index=pd.Index(models, name="model"), dtype=object)
    frame.attrs["note"] = recall_note(rule_sets, lacking)
    return frame


def recall_note(rule_sets: list[str], lacking: dict[str, list[str]]) -> str:
    """How to read the table: the unit, the rules each set of columns ran under, what Avg. covers."""
    parts = ["share of documents whose greedy output contains a label (case-insensitive), in %"]
    kinds = list(dict.fromkeys("jrt" if rules.startswith("jrt") else rules for rules in rule_sets))
    parts += [RULES_DESCRIPTIONS.get(kind, f"{kind}: the results do not record the rules") for kind in kinds]
    if len(rule_sets) == 1:
        parts.append(f"rules: {rule_sets[0]}")
    else:
        parts.append("units run under different rules are in separate columns, each header naming its rules")
    average = f"{AVERAGE_HEADER}: mean of the six columns"
    if lacking:
        reasons = "; ".join(f"{model} lacks {', '.join(headers)}" for model, headers in sorted(lacking.items()))
        average += f" ('-' for a model without all six: {reasons})"
    parts.append(average)
    return "; ".join(parts)


def recall_columns(frame: pd.DataFrame) -> list[str]:
    """The columns of a recall_pivot frame (all accuracies in %), Avg. columns only where a model has one."""
    return [column for column in frame.columns if not column.startswith(AVERAGE_HEADER)
            or frame[column].map(lambda v: isinstance(v, float) and math.isfinite(v)).any()]
