"""The recall table (`table --view recall`): the papers' columns and Avg., units run under other rules in
columns of their own, a model without all six, failed values, and the view without recall results."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from ccq_eval.analysis import tables
from ccq_eval.analysis.recall import recall_pivot
from ccq_eval.analysis.tidy import TIDY_COLUMNS

OURS = ["ccq_recall_swde", "ccq_recall_squad", "ccq_recall_fda", "ccq_recall_triviaqa", "ccq_recall_nq",
        "ccq_recall_drop"]


def tidy(rows: list[tuple[str, str, float, str]]) -> pd.DataFrame:
    """(model, task, contains, rules) -> tidy rows as tidy_table writes them."""
    frame = pd.DataFrame([{column: None for column in TIDY_COLUMNS} | {
        "model": model, "task": task, "family": "recall", "metric": "contains", "filter": "none", "value": value,
        "primary": True, "higher_is_better": True, "protocol": rules, "source": "x"}
        for model, task, value, rules in rows], columns=TIDY_COLUMNS)
    frame["length"] = pd.array([pd.NA] * len(frame), dtype="Int64")
    return frame


def test_the_papers_columns_in_percent_with_their_mean():
    values = [0.5, 0.25, 0.75, 0.0, 1.0, 0.5]
    frame = recall_pivot(tidy([("m", task, v, "jrt, 2048 tokens") for task, v in zip(OURS, values, strict=True)]))
    assert list(frame.columns) == ["SWDE", "SQD", "FDA", "TQA", "NQ", "DROP", "Avg."]
    assert list(frame.loc["m"]) == [50.0, 25.0, 75.0, 0.0, 100.0, 50.0, pytest.approx(50.0)]
    assert "rules: jrt, 2048 tokens" in frame.attrs["note"]


def test_other_rules_never_share_a_column():
    rows = [("a", task, 0.5, "jrt, 2048 tokens") for task in OURS]
    rows += [("b", task, 0.25, "jrt, 1024 tokens, read twice") for task in OURS]
    rows += [("c", "swde", 1.0, "lm-eval")]
    frame = recall_pivot(tidy(rows))
    assert list(frame.columns[:7]) == [f"{h} (jrt, 1024 tokens, read twice)" for h in
                                       ("SWDE", "SQD", "FDA", "TQA", "NQ", "DROP", "Avg.")]
    assert frame.loc["a", "SWDE (jrt, 2048 tokens)"] == 50.0 and math.isnan(frame.loc["a", "SWDE (lm-eval)"])
    assert frame.loc["c", "SWDE (lm-eval)"] == 100.0 and math.isnan(frame.loc["c", "SWDE (jrt, 2048 tokens)"])
    assert math.isnan(frame.loc["c", "Avg. (lm-eval)"])
    assert "c (lm-eval) lacks SQD, FDA, TQA, NQ, DROP" in frame.attrs["note"]


def test_a_failed_value_shows_as_failed_and_so_does_the_mean():
    rows = [("m", task, math.nan if task == "ccq_recall_nq" else 0.5, "jrt, 2048 tokens") for task in OURS]
    frame = recall_pivot(tidy(rows))
    assert isinstance(frame.loc["m", "NQ"], str) and isinstance(frame.loc["m", "Avg."], str)


def test_the_view_renders_only_the_recall_table_and_refuses_results_without_it():
    text = tables.render_tables(tidy([("m", task, 0.5, "jrt, 2048 tokens") for task in OURS]), view="recall")
    assert text.startswith("### Recall-intensive tasks (Based / JRT)")
    assert "| model | SWDE | SQD | FDA | TQA | NQ | DROP | Avg. |" in text
    with pytest.raises(tables.AnalysisOptionError, match="hold no recall task"):
        tables.render_tables(tidy([]), view="recall")
