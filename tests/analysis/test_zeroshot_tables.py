"""The zero-shot suite's analysis on hand-built results: each task's primary metric and direction, the
protocol a rolling task was scored by, the papers' table (columns, percent, Avg., protocols never sharing a
column, failures) in every format, and the compare summary's columns."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import pytest

from ccq_eval.analysis import comparison_tables, tables, tidy, zeroshot
from ccq_eval.harness.store import StoredUnit
from ccq_eval.task_families import ZEROSHOT_AVERAGED, ZEROSHOT_PAPER_COLUMNS

HEADERS = {(task, metric): header for task, metric, header in ZEROSHOT_PAPER_COLUMNS}


def _frame(values: dict[str, dict[tuple[str, str], float]], protocols: dict[str, str | None] | None = None,
           extra: tuple[tuple[str, str], ...] = ()) -> pd.DataFrame:
    """A tidy frame of overall zero-shot values: model -> {(task, metric): value}; wikitext's rows carry the
    model's protocol. `extra`: (task, metric) rows of metrics the papers do not show, value 0.5."""
    rows = []
    for model, cells in values.items():
        for (task, metric), value in list(cells.items()) + [(key, 0.5) for key in extra]:
            rows.append({"model": model, "task": task, "family": "zeroshot", "metric": metric, "filter": "none",
                         "value": value, "n": 3, "higher_is_better": tidy.metric_direction(metric),
                         "primary": True, "source": f"{model}/{task}/results.json",
                         "protocol": (protocols or {}).get(model, "hflm") if task == "wikitext" else None})
    frame = pd.DataFrame(rows).reindex(columns=tidy.TIDY_COLUMNS)
    frame["length"] = frame["length"].astype("Int64")
    frame["depth"] = frame["depth"].astype("Float64")
    return frame


def _all_columns(offset: float) -> dict[tuple[str, str], float]:
    """A value for every paper column: perplexities above 1, accuracies in [0, 1]."""
    values = {}
    for index, (task, metric, _) in enumerate(ZEROSHOT_PAPER_COLUMNS):
        values[(task, metric)] = 10.0 + index + offset if "perplexity" in metric else (index + offset) / 20
    return values


def test_primary_metric_is_the_papers_metric_of_each_task():
    def infos(*names: str) -> list[tidy.MetricInfo]:
        return [tidy.MetricInfo(name, None, None) for name in names]

    assert tidy.primary_metric("hellaswag", infos("acc", "acc_norm")) == "acc_norm"
    assert tidy.primary_metric("arc_challenge", infos("acc", "acc_norm")) == "acc_norm"
    assert tidy.primary_metric("wikitext", infos("word_perplexity", "byte_perplexity", "bits_per_byte")) \
        == "word_perplexity"
    for task in ("piqa", "arc_easy", "lambada_openai", "openbookqa"):
        assert tidy.primary_metric(task, infos("perplexity", "acc", "acc_norm")) == "acc"
    assert tidy.primary_metric("ccq_s_niah_1", infos("acc", "acc_1024")) == "acc"
    assert tidy.primary_metric("mmlu", infos("exact_match", "acc")) == "exact_match"  # not ours: its first


def test_direction_lower_for_perplexities_higher_for_accuracies_unless_stated():
    for metric in ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert tidy.metric_direction(metric) is False
    assert tidy.metric_direction("acc") is True and tidy.metric_direction("acc_norm") is True
    assert tidy.metric_direction("f1") is None
    assert tidy.metric_direction("acc", False) is False  # what the results state wins


def _unit(task: str, config: dict, metric_list: list[dict], output_type: str = "loglikelihood_rolling") -> StoredUnit:
    results = {"results": {task: {"word_perplexity,none": 20.0}}, "config": config,
               "configs": {task: {"metric_list": metric_list, "output_type": output_type}}}
    return StoredUnit(Path("run") / "m" / task / "results.json", results)


def test_lm_eval_defaults_fill_what_wikitext_metric_list_leaves_out():
    unit = _unit("wikitext", {}, [{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}, {"metric": "acc"}])
    found = {info.name: (info.aggregation, info.higher_is_better) for info in tidy.metric_infos(unit, "wikitext")}
    assert found == {"word_perplexity": ("weighted_perplexity", False), "bits_per_byte": ("bits_per_byte", False),
                     "acc": ("mean", True)}


def test_the_protocol_comes_from_the_results_config():
    scoring = {"ccq_scoring": {"rolling_windows": "carry", "rolling_protocol_by_task": {"wikitext": "carry"}}}
    assert tidy.scoring_protocol(_unit("wikitext", scoring, []), "wikitext") == "carry"
    assert tidy.scoring_protocol(_unit("piqa", scoring, [], "multiple_choice"), "piqa") is None
    assert tidy.scoring_protocol(_unit("wikitext", {"model": "hf"}, []), "wikitext") == "hflm"  # lm-eval's HFLM
    assert tidy.scoring_protocol(_unit("wikitext", {"model": "CUSTOM"}, []), "wikitext") is None


def test_paper_table_columns_percent_and_average():
    values = {"gla": _all_columns(0.0), "gla-ccq": _all_columns(1.0)}
    del values["gla-ccq"][("boolq", "acc")]
    frame = zeroshot.zeroshot_pivot(_frame(values, extra=(("piqa", "acc_norm"), ("wikitext", "bits_per_byte"))))
    wiki = "Wiki. ppl (HFLM windows)"
    assert list(frame.columns) == [wiki if h == "Wiki. ppl" else h for _, _, h in ZEROSHOT_PAPER_COLUMNS] + ["Avg."]
    assert list(frame.index) == ["gla", "gla-ccq"]
    for model, cells in values.items():
        for (task, metric), value in cells.items():
            header = HEADERS[(task, metric)]
            shown = frame.at[model, wiki if header == "Wiki. ppl" else header]
            assert shown == pytest.approx(100 * value if metric.startswith("acc") else value, rel=1e-12)
    expected = math.fsum(values["gla"][key] for key in ZEROSHOT_AVERAGED) / len(ZEROSHOT_AVERAGED) * 100
    assert frame.at["gla", "Avg."] == pytest.approx(expected, rel=1e-12)
    assert math.isnan(frame.at["gla-ccq", "Avg."]) and math.isnan(frame.at["gla-ccq", "BoolQ acc"])
    note = frame.attrs["note"]
    assert "gla-ccq lacks BoolQ acc" in note and "HFLM windows:" in note
    assert ", ".join(HEADERS[key] for key in ZEROSHOT_AVERAGED) in note


def test_only_the_columns_some_model_has():
    values = {"m": {("piqa", "acc"): 0.5, ("lambada_openai", "perplexity"): 12.0, ("hellaswag", "acc"): 0.25}}
    frame = zeroshot.zeroshot_pivot(_frame(values))
    assert list(frame.columns) == ["LMB. ppl", "PIQA acc", "Avg."]  # hellaswag's acc is not the papers' metric
    assert math.isnan(frame.at["m", "Avg."])
    assert zeroshot.zeroshot_pivot(_frame({"m": {("hellaswag", "acc"): 0.25}})) is None


def test_models_scored_by_different_protocols_never_share_a_column():
    values = {"a": {("wikitext", "word_perplexity"): 20.0}, "b": {("wikitext", "word_perplexity"): 30.0},
              "c": {("wikitext", "word_perplexity"): 40.0}}
    frame = zeroshot.zeroshot_pivot(_frame(values, protocols={"a": "hflm", "b": "carry", "c": None}))
    columns = ["Wiki. ppl (HFLM windows)", "Wiki. ppl (state carried)", "Wiki. ppl (protocol not recorded)"]
    assert list(frame.columns) == [*columns, "Avg."]
    for model, column, value in zip("abc", columns, (20.0, 30.0, 40.0)):
        assert frame.at[model, column] == value
        assert all(math.isnan(frame.at[model, other]) for other in columns if other != column)
    note = frame.attrs["note"]
    assert "state carried: one pass" in note and "separate columns" in note and "do not record" in note


def test_a_failed_value_is_shown_failed_and_fails_the_average():
    values = {"m": _all_columns(0.0)}
    values["m"][("piqa", "acc")] = math.nan
    frame = zeroshot.zeroshot_pivot(_frame(values))
    assert frame.at["m", "PIQA acc"] == "NaN (failed)" and frame.at["m", "Avg."] == "NaN (failed)"
    [pivot] = [p for p in tables.paper_pivots(_frame(values)) if "Avg." in p.frame.columns]
    assert tables.NON_FINITE_NOTE in pivot.note and "Avg.: mean of the 8" in pivot.note


def test_paper_view_in_every_format_escapes_names():
    values = {"gla|x": _all_columns(0.0), "=gla": _all_columns(2.0)}
    frame = _frame(values)
    markdown = tables.render_tables(frame, "markdown", "paper")
    assert "| gla\\|x | " in markdown and "Wiki. ppl (HFLM windows)" in markdown
    assert f"| {100 * values['gla|x'][('piqa', 'acc')]:.2f} |" in markdown
    latex = tables.render_tables(frame, "latex", "paper")
    assert r"Hella. acc\_n" in latex and r"gla|x" in latex
    csv = tables.render_tables(frame, "csv", "paper")
    body = csv.split("\n", 1)[1]
    parsed = pd.read_csv(io.StringIO(body), index_col="model")
    assert parsed.at["'=gla", "PIQA acc"] == pytest.approx(100 * values["=gla"][("piqa", "acc")], rel=1e-12)


def test_tidy_view_shows_the_protocol_only_where_results_have_one():
    frame = _frame({"m": {("wikitext", "word_perplexity"): 20.0, ("piqa", "acc"): 0.5}})
    assert "| protocol |" in tables.render_tables(frame, "markdown", "tidy")
    without = frame.assign(protocol=None)
    assert "protocol" not in tables.render_tables(without, "markdown", "tidy")
    assert "protocol" in tables.render_tables(without, "csv", "tidy").splitlines()[0]  # csv keeps every column


def _compare_row(task: str, metric: str, delta: float, protocol: str = "") -> dict:
    return {"task": task, "length": "all", "metric": metric, "delta": delta, "ci_low": delta - 1,
            "ci_high": delta + 1, "p_value": 0.5, "protocol": protocol}


def test_compare_summary_names_zero_shot_columns_as_the_papers():
    frame = pd.DataFrame([_compare_row("piqa", "acc", 0.1), _compare_row("lambada_openai", "acc", 0.2),
                          _compare_row("lambada_openai", "perplexity", -3.0),
                          _compare_row("wikitext", "word_perplexity", -2.0, "HFLM windows"),
                          _compare_row("ccq_s_niah_1", "acc", 5.0)])
    table = comparison_tables.comparison_summary([("gla", "gla-ccq", frame)], p_adjust="none")
    assert list(table.columns) == ["S-NIAH-1", "Wiki. ppl (HFLM windows)", "LMB. ppl", "LMB. acc", "PIQA acc"]
    assert table.at["gla-ccq vs gla", "LMB. ppl"].startswith("-3 [-4, -2]")
