"""`ccq-eval table / compare / figures` on tiny results written by the tests (no model)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from test_cli_fakes import (
    BUCKETS_BASE,
    LONGBENCH_BASE,
    SNIAH_TASK,
    SWEEP_BASE,
    baseline_correct,
    revouch,
    write_all,
    write_longbench_e,
    write_sniah,
)
from typer.testing import CliRunner

from ccq_eval import atomic_io, cli
from ccq_eval.analysis import figures, tables
from ccq_eval.harness import store

BASE, VAR = "tiny-gla", "tiny-gla-ccq"


def invoke(*args: str):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return write_all(tmp_path_factory.mktemp("results") / "results", BASE, VAR)


@pytest.fixture(scope="module")
def tidy(results) -> pd.DataFrame:
    return tables.load_tidy(results)


def _value(tidy, **where) -> float:
    rows = tidy
    for column, wanted in where.items():
        rows = rows[rows[column].isna()] if wanted is None else rows[rows[column] == wanted]
    assert len(rows) == 1, (where, rows)
    return float(rows["value"].iloc[0])


def test_tidy_table_values(tidy):
    assert {"model", "task", "length", "depth", "metric", "value", "n"} <= set(tidy.columns)
    # S-NIAH: baseline right at 1K, and at 2K only at depth 0 (4 of 12)
    assert _value(tidy, model=BASE, task=SNIAH_TASK, metric="acc", length=1024, depth=None) == 100.0
    assert _value(tidy, model=BASE, task=SNIAH_TASK, metric="acc", length=2048, depth=None) == pytest.approx(100 / 3)
    assert _value(tidy, model=VAR, task=SNIAH_TASK, metric="acc", length=2048, depth=None) == pytest.approx(200 / 3)
    assert _value(tidy, model=BASE, task=SNIAH_TASK, metric="acc", length=2048, depth=0.0) == 100.0
    assert _value(tidy, model=BASE, task=SNIAH_TASK, metric="acc", length=2048, depth=50.0) == 0.0
    cell = tidy[(tidy["model"] == BASE) & (tidy["length"] == 2048) & (tidy["depth"] == 50.0)]
    assert int(cell["n"].iloc[0]) == 4
    per_length = tidy[(tidy["model"] == BASE) & (tidy["task"] == SNIAH_TASK) & (tidy["length"] == 2048)
                      & tidy["depth"].isna() & (tidy["metric"] == "acc")]
    assert len(per_length) == 1 and int(per_length["n"].iloc[0]) == 12  # value from results.json, n from samples
    assert not (tidy["metric"] == "acc_2048").any()  # folded into metric acc at length 2048
    # perplexity sweep: exp(mean NLL per token) over equal-length documents
    assert _value(tidy, model=BASE, task="ccq_ppl_sweep", metric="ppl", length=1024) == pytest.approx(
        math.exp(sum(SWEEP_BASE[1024]) / 3))
    # position buckets: length = end of the bucket
    assert _value(tidy, model=BASE, task="ccq_ppl_buckets", metric="ppl", bucket="512-1024") == pytest.approx(
        math.exp((BUCKETS_BASE[0][1] + BUCKETS_BASE[1][1]) / 2))
    # LongBench: mean of per-sample scores
    assert _value(tidy, model=BASE, task="ccq_longbench_qasper", metric="score") == pytest.approx(20.0)


def test_table_markdown_paper_view(results):
    result = invoke("table", results)
    assert result.exit_code == 0, result.output
    text = result.output
    assert "### S-NIAH accuracy per length" in text
    assert "| S-NIAH-1 | tiny-gla | 100.00 | 33.33 |" in text
    assert "| S-NIAH-1 | tiny-gla-ccq | 100.00 | 66.67 |" in text
    assert "Perplexity per length (truncated-document sweep)" in text
    assert "Perplexity per position bucket" in text
    # LongBench: datasets, category averages and the mean of categories
    lb = {d: sum(v) / len(v) for d, v in LONGBENCH_BASE.items()}
    line = next(line for line in text.splitlines() if line.startswith("| tiny-gla |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    header = next(line for line in text.splitlines() if line.startswith("| model | qasper"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    row = dict(zip(columns, cells))
    assert float(row["qasper"]) == pytest.approx(lb["qasper"])
    assert float(row["Multi-Doc QA avg"]) == pytest.approx(lb["hotpotqa"])
    assert float(row["Avg (categories)"]) == pytest.approx((lb["qasper"] + lb["hotpotqa"] + lb["lcc"]) / 3, abs=0.01)


def test_table_csv_tidy_round_trips(results, tidy):
    result = invoke("table", results, "--format", "csv", "--view", "tidy")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(io.StringIO(result.output))
    assert len(frame) == len(tidy)
    row = frame[(frame["model"] == VAR) & (frame["task"] == SNIAH_TASK) & (frame["length"] == 2048)
                & frame["depth"].isna() & (frame["metric"] == "acc")]
    assert float(row["value"].iloc[0]) == pytest.approx(200 / 3)


def test_table_latex_and_output_file(results, tmp_path):
    out = tmp_path / "table.tex"
    result = invoke("table", results, "--format", "latex", "--output", out)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.count(r"\begin{tabular}") >= 3 and r"\toprule" in text
    assert r"S-NIAH-1 & tiny-gla & 100.00 & 33.33 \\" in text
    assert "ppl\\_sweep" in text  # underscores escaped


def test_compare_reports_delta_ci_and_mcnemar(results):
    result = invoke("compare", results, "--baseline", BASE, "--variant", VAR, "--format", "csv", "--n-boot", 2000)
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(io.StringIO(result.output))
    row = frame[(frame["task"] == SNIAH_TASK) & (frame["length"] == "2048")].iloc[0]
    assert row["baseline"] == pytest.approx(100 / 3) and row["variant"] == pytest.approx(200 / 3)
    assert row["delta"] == pytest.approx(100 / 3)
    assert row["ci_low"] <= row["delta"] <= row["ci_high"]
    assert row["p_value"] == pytest.approx(2 / 2**4)  # b = 0, c = 4: exact McNemar
    assert row["n"] == 12 and row["pairing"] == "doc_hash"
    same = frame[(frame["task"] == SNIAH_TASK) & (frame["length"] == "1024")].iloc[0]
    assert same["delta"] == 0 and same["ci_low"] == 0 and same["ci_high"] == 0 and same["p_value"] == 1
    sweep = frame[(frame["task"] == "ccq_ppl_sweep") & (frame["length"] == "2048")].iloc[0]
    assert sweep["delta"] < 0 and sweep["statistic"] == "nll_pairs" and sweep["test"].startswith("sign test")
    assert {"all", "0-512", "512-1024"} <= set(frame[frame["task"] == "ccq_ppl_buckets"]["length"])


def test_compare_markdown_marks_significance(tmp_path):
    # 48 paired samples where the variant fixes 12 of the baseline's errors and breaks none
    folder = tmp_path / "r"
    write_sniah(folder, "base", lambda length, depth, i: length == 1024)
    write_sniah(folder, "var", lambda length, depth, i: True)
    result = invoke("compare", folder, "--baseline", "base", "--variant", "var", "--n-boot", 1000)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("| S-NIAH-1 | 2048 |"))
    # p = 2^-11; Holm over the 3 p-values printed (all, 1K, 2K): 3 * 2^-11, beside the raw one
    assert "| 0.00146 | 0.000488 | ** |" in line and "variant better" in line
    assert "McNemar exact (b=0, c=12)" in line


def test_compare_identical_models_zero_delta(tmp_path):
    folder = tmp_path / "r"
    write_sniah(folder, "a", baseline_correct)
    write_sniah(folder, "b", baseline_correct)
    result = invoke("compare", folder, "--baseline", "a", "--variant", "b", "--format", "csv", "--n-boot", 500)
    frame = pd.read_csv(io.StringIO(result.output))
    assert (frame["delta"] == 0).all() and (frame["ci_low"] <= 0).all() and (frame["ci_high"] >= 0).all()
    assert (frame["p_value"] == 1).all() and frame["sig"].isna().all()


def test_compare_is_deterministic(results):
    args = ["compare", results, "--baseline", BASE, "--variant", VAR, "--format", "csv", "--n-boot", 500]
    assert invoke(*args).output == invoke(*args).output
    assert invoke(*args).output != invoke(*args, "--seed", 1).output


def test_figures_writes_png_and_pdf(results, tmp_path):
    out = tmp_path / "figs"
    result = invoke("figures", results, "--output", out)
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    for stem in ("sniah_heatmap_S-NIAH-1", "sniah_accuracy_vs_length", "ppl_vs_length_sweep",
                 "ppl_vs_position_buckets", "longbench_per_dataset"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
    assert set(result.output.split()) == {str(out / n) for n in names}


def test_model_colours_are_stable_and_distinct():
    four = figures.model_colors(["tiny-gla", "tiny-gla-ccq", "tiny-gdn", "tiny-gdn-ccq"])
    two = figures.model_colors(["tiny-gla-ccq", "tiny-gla"])
    assert four["tiny-gla"] == two["tiny-gla"] and four["tiny-gla-ccq"] == two["tiny-gla-ccq"]
    assert len(set(four.values())) == 4
    # a variant shares its baseline's hue: the light shade is the dark one mixed with white
    dark, light = four["tiny-gla-ccq"][:3], four["tiny-gla"][:3]
    assert all(line == pytest.approx(0.6 * d + 0.4) for d, line in zip(dark, light))


def test_missing_empty_and_corrupt_results(tmp_path):
    missing = tmp_path / "nothing-here"
    for command in (["table"], ["figures"], ["compare", "--baseline", "a", "--variant", "b"]):
        result = invoke(command[0], missing, *command[1:])
        assert result.exit_code == 2 and "does not exist" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = invoke("table", empty)
    assert result.exit_code == 2 and "holds no results" in result.output

    folder = tmp_path / "corrupt"
    unit = write_sniah(folder, "a", baseline_correct)
    broken = unit / "results.json"
    broken.write_text('{"results": {"ccq_s_niah_1": ')
    before = broken.read_bytes()
    for command in (["table"], ["figures"], ["compare", "--baseline", "a", "--variant", "b"]):
        result = invoke(command[0], folder, *command[1:])
        assert result.exit_code == 2
        assert str(broken) in result.output and "not valid JSON" in result.output
    assert broken.read_bytes() == before

    samples = unit / f"samples_{SNIAH_TASK}.jsonl"
    broken.write_text(json.dumps({"results": {SNIAH_TASK: {"acc,none": 50.0}}}))
    samples.write_text(samples.read_text() + "{oops\n")
    result = invoke("table", folder)
    assert result.exit_code == 2 and f"{samples} line 25" in result.output


def test_compare_bad_input(results):
    result = invoke("compare", results, "--baseline", BASE, "--variant", "nope")
    assert result.exit_code == 2 and "no results for model 'nope'" in result.output and BASE in result.output
    result = invoke("compare", results, "--baseline", BASE, "--variant", BASE)
    assert result.exit_code == 2 and "same model" in result.output
    result = invoke("compare", results, "--baseline", BASE, "--variant", VAR, "--metric", "f1")
    assert result.exit_code == 2 and "no metric 'f1'" in result.output
    result = invoke("table", results, "--format", "html")
    flat = " ".join(result.output.replace("│", " ").split())  # the error box may wrap the line
    assert result.exit_code == 2 and "'html' is not one of 'markdown', 'csv', 'latex'" in flat


def test_same_unit_in_two_runs_is_reported(tmp_path):
    write_sniah(tmp_path / "run1", "a", baseline_correct)
    write_sniah(tmp_path / "run2", "a", baseline_correct)
    result = invoke("table", tmp_path)
    assert result.exit_code == 2 and "more than one file" in result.output


def test_atomic_write_keeps_old_file_when_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    store.atomic_write_json(path, {"old": 1})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        store.atomic_write_json(path, {"new": 2})
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_per_length_values_are_recomputed_from_samples_when_results_lack_them(tmp_path):
    unit = write_sniah(tmp_path / "r", "a", baseline_correct)
    stored = json.loads((unit / "results.json").read_text())
    stored["results"][SNIAH_TASK] = {k: v for k, v in stored["results"][SNIAH_TASK].items()
                                     if not k.startswith("acc_")}
    (unit / "results.json").write_text(json.dumps(stored))
    revouch(unit)
    tidy = tables.load_tidy(tmp_path / "r")
    assert _value(tidy, metric="acc", length=1024, depth=None) == 100.0
    assert _value(tidy, metric="acc", length=2048, depth=None) == pytest.approx(100 / 3)
    assert _value(tidy, metric="acc", length=None, depth=None) == pytest.approx(200 / 3)


def test_longbench_e_buckets_in_table_and_compare(tmp_path):
    folder = tmp_path / "r"
    write_longbench_e(folder, "a", "qasper", [("0-4k", 10.0), ("0-4k", 30.0), ("4-8k", 0.0), ("8k+", 50.0)])
    write_longbench_e(folder, "b", "qasper", [("0-4k", 20.0), ("0-4k", 30.0), ("4-8k", 10.0), ("8k+", 40.0)])
    tidy = tables.load_tidy(folder)
    assert _value(tidy, model="a", metric="score", bucket="0-4k") == 20.0
    assert _value(tidy, model="a", metric="score", bucket=None) == 22.5
    result = invoke("table", folder)
    assert "### LongBench-E per length bucket" in result.output
    assert "| qasper | a | 20.00 | 0.00 | 50.00 |" in result.output
    result = invoke("compare", folder, "--baseline", "a", "--variant", "b", "--format", "csv", "--n-boot", 200)
    frame = pd.read_csv(io.StringIO(result.output))
    assert list(frame["length"]) == ["all", "0-4k", "4-8k", "8k+"]
    assert list(frame["n"]) == [4, 2, 1, 1]
    assert frame.iloc[0]["delta"] == pytest.approx(2.5) and frame.iloc[0]["test"] == "sign test (+2/-1)"


def test_archive_keeps_tables_and_comparisons_and_drops_long_texts(results, tmp_path):
    """`ccq-eval archive`: compact copy (xz samples, long prompts as digests, no resume cache) from
    which `table` and `compare` give exactly what they give on the original results."""
    long_text = "haystack " * 400
    unit = next(p.parent for p in results.rglob("samples_*.jsonl") if (p.parent / "results.json").is_file())
    (unit / store.RESPONSES_DB).write_bytes(b"resume cache")
    samples = next(unit.glob("samples_*.jsonl"))
    original = samples.read_text(encoding="utf-8")
    records = [json.loads(line) for line in original.split("\n") if line]
    records[0]["doc"]["haystack"] = long_text
    samples.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    revouch(unit)
    try:
        archived = tmp_path / "archive"
        result = invoke("archive", results, archived)
        assert result.exit_code == 0, result.output
        copy = archived / unit.relative_to(results)
        assert not list(archived.rglob("*.sqlite")) and not list(archived.rglob("*.jsonl"))
        first = next(store.iter_jsonl(copy / (samples.name + ".xz")))
        assert first["doc"]["haystack"].startswith(f"<{len(long_text)} chars, sha256 ")
        assert first["metrics"] == records[0]["metrics"]
        for command in (["table", "{}"], ["table", "{}", "--view", "tidy"],
                        ["compare", "{}", "--baseline", BASE, "--variant", VAR, "--n-boot", "200"]):
            outputs = [invoke(*[a.format(folder) for a in command]) for folder in (results, archived)]
            assert outputs[0].exit_code == 0 and outputs[0].output == outputs[1].output, command
        assert (archived / "table.md").read_text(encoding="utf-8") == invoke("table", archived).output
        assert (copy / store.ARCHIVED_RESULTS_FILE).is_file() and not (copy / store.RESULTS_FILE).exists()
        assert invoke("archive", results, results / "inside").exit_code == 2
    finally:
        samples.write_text(original, encoding="utf-8")
        revouch(unit)
        (unit / store.RESPONSES_DB).unlink()
