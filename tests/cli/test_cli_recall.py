"""`ccq-eval run` on the recall table: the alias and the suites, --recall-dir (data recorded by content), the
protocol, length and prompt in the unit's identity, the one-line stop without data (nothing written), and
run -> table --view recall -> compare end to end, offline, on tests/fixtures/recall."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness.options import PlanError
from ccq_eval.harness.run_options import options_command_line
from ccq_eval.harness.task_registry import RECALL_TASKS

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "recall"
HEADERS = ["SWDE", "SQD", "FDA", "TQA", "NQ", "DROP", "Avg."]


def invoke(*args: str):
    return CliRunner().invoke(cli.app, [str(arg) for arg in args])


def _plan(tmp_path: Path, **options) -> run_plan.RunPlan:
    options = {"models": ["tiny-gla"], "tasks": ["recall"], "output": tmp_path / "out"} | options
    return run_plan.plan_run(run_plan.RunOptions(**options))


@pytest.fixture
def no_hub_data(monkeypatch):
    """The hub off and nothing in the datasets cache, as `datasets` reports it offline."""
    import datasets

    def missing(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset_builder", missing)


def test_units_record_data_by_content_and_the_rules_in_their_identity(tmp_path):
    first = _plan(tmp_path, recall_dir=shutil.copytree(FIXTURES, tmp_path / "a"))
    copy = _plan(tmp_path, recall_dir=shutil.copytree(FIXTURES, tmp_path / "b"), output=tmp_path / "out2")
    assert [unit.task for unit in first.units] == list(RECALL_TASKS) and not first.notes
    assert [unit.spec for unit in first.units] == [unit.spec for unit in copy.units]  # the folder is not identity
    swde = first.units[0].spec
    assert swde["task_metadata"] == {"seed": 0, "recall_length": 2048, "recall_prompt": "once"}
    assert list(swde["data_files"]) == ["swde/validation.jsonl"]
    assert first.units[4].spec["data_files"].keys() == {"nq_2048/validation.jsonl"}
    twice = _plan(tmp_path, recall_dir=FIXTURES, recall_prompt="twice", recall_length=512, output=tmp_path / "o3")
    assert twice.units[0].spec["task_metadata"]["recall_prompt"] == "twice"
    assert twice.units[4].spec["data_files"].keys() == {"nq_512/validation.jsonl"}
    assert "--recall-prompt" in options_command_line(twice.options)


def test_lm_eval_protocol_runs_lm_evals_own_tasks(tmp_path):
    plan = _plan(tmp_path, recall_dir=FIXTURES, recall_protocol="lm-eval")
    assert [unit.task for unit in plan.units] == ["swde", "squad_completion", "fda"]
    assert plan.notes == ["--recall-protocol lm-eval: ccq_recall_triviaqa, ccq_recall_nq, ccq_recall_drop left out "
                          "(lm-eval ships only swde, fda and squad_completion with the document in the prompt)"]
    assert plan.units[0].spec["task_metadata"] == {"seed": 0}  # neither cut nor prompt mode applies
    assert plan.units[0].spec["data_files"] == {"swde/validation.jsonl": _plan(
        tmp_path, recall_dir=FIXTURES, output=tmp_path / "o2").units[0].spec["data_files"]["swde/validation.jsonl"]}


@pytest.mark.parametrize(("options", "message"), [
    ({"recall_protocol": "lm-eval", "recall_prompt": "twice"}, "--recall-prompt set the jrt protocol's cut"),
    ({"recall_length": 48}, "--recall-length 48: the cut keeps that many tokens less the 48"),
    ({"recall_length": 3000}, "--recall-length 3000 has no NQ dataset"),
    ({"tasks": ["s-niah-1"], "recall_length": 1024}, "no recall task was selected"),
    ({"tasks": ["ccq_recall_drop"], "recall_protocol": "lm-eval"}, "ccq_recall_drop has no lm-eval version"),
])
def test_bad_recall_options_stop_in_one_line(tmp_path, options, message):
    with pytest.raises(PlanError, match=message) as raised:
        _plan(tmp_path, recall_dir=FIXTURES, **options)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_a_bad_row_stops_planning_naming_file_line_and_field(tmp_path):
    folder = Path(shutil.copytree(FIXTURES, tmp_path / "data"))
    rows = (folder / "triviaqa" / "validation.jsonl").read_text().splitlines()
    rows[1] = rows[1].replace('"answers": ["Jane Austen", "Austen"]', '"answers": []')
    (folder / "triviaqa" / "validation.jsonl").write_text("\n".join(rows) + "\n")
    result = invoke("run", "-m", "tiny-gla", "-t", "recall", "--recall-dir", folder, "-o", tmp_path / "out")
    assert result.exit_code != 0
    assert (f"{folder / 'triviaqa' / 'validation.jsonl'} line 2: field 'answers' is [], expected a non-empty list "
            "of strings") in result.output
    assert not (tmp_path / "out").exists()


def test_without_data_one_line_names_the_datasets_and_nothing_is_written(tmp_path, no_hub_data):
    result = invoke("run", "-m", "tiny-gla", "-t", "recall", "-o", tmp_path / "out")
    assert result.exit_code != 0
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line.startswith("Error: the recall tasks' data is missing: hazyresearch/based-swde-v2, "
                           "hazyresearch/based-squad, hazyresearch/based-fda, hazyresearch/based_triviaqa, "
                           "hazyresearch/based_nq_2048, hazyresearch/based_drop")
    assert "datasets.load_dataset('hazyresearch/based_drop')" in line and "--recall-dir FOLDER" in line
    assert not (tmp_path / "out").exists()


def test_suite_paper_takes_recall_where_its_data_is_found(tmp_path, no_hub_data):
    without = _plan(tmp_path, tasks=[], suite="paper", models=["tiny-gla"])
    assert not any(unit.task.startswith("ccq_recall") for unit in without.units)
    assert [note for note in without.notes if "recall" in note] == [
        "--suite paper: recall skipped (no --recall-dir, and neither the hub nor the datasets cache holds "
        "hazyresearch/based-swde-v2, hazyresearch/based-squad, hazyresearch/based-fda, hazyresearch/based_triviaqa, "
        "hazyresearch/based_nq_2048, hazyresearch/based_drop; docs/recall.md says how to get them)"]
    partial = Path(shutil.copytree(FIXTURES, tmp_path / "partial"))
    shutil.rmtree(partial / "drop")
    found = _plan(tmp_path, tasks=[], suite="paper", recall_dir=partial, output=tmp_path / "o2")
    assert [unit.task for unit in found.units if unit.task.startswith("ccq_recall")] == list(RECALL_TASKS[:-1])
    assert any(note.startswith("--suite paper: ccq_recall_drop skipped") for note in found.notes)
    suite = _plan(tmp_path, tasks=[], suite="recall", recall_dir=FIXTURES, output=tmp_path / "o3")
    assert [unit.task for unit in suite.units] == list(RECALL_TASKS)


@pytest.mark.slow
def test_run_table_and_compare_offline_on_the_fixtures(tmp_path):
    """The issue's command on the 2-core CPU: six units per model, the papers' table and the paired tests."""
    out = tmp_path / "out"
    result = invoke("run", "-m", "tiny-gla", "-m", "tiny-gla-ccq", "-t", "recall", "--recall-dir", FIXTURES,
                    "-o", out, "--no-report")
    assert result.exit_code == 0, result.output
    assert "12 evaluated" in result.output
    table = invoke("table", out, "--view", "recall")
    assert table.exit_code == 0, table.output
    header = next(line for line in table.output.splitlines() if line.startswith("| model"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == ["model", *HEADERS]
    assert "rules: jrt, 2048 tokens" in table.output
    compare = invoke("compare", out, "--baseline", "tiny-gla", "--variant", "tiny-gla-ccq")
    assert compare.exit_code == 0, compare.output
    rows = [line for line in compare.output.splitlines() if line.startswith("| recall ")]
    assert len(rows) == 6 and all("McNemar exact" in row and "contains (jrt, 2048 tokens)" in row for row in rows)
    assert "Holm" in compare.output
    summary = invoke("compare", out, "--baseline", "tiny-gla", "--variant", "tiny-gla-ccq", "--summary")
    header = next(line for line in summary.output.splitlines() if line.startswith("| comparison"))
    assert [cell.split(" (")[0].strip() for cell in header.strip("|").split("|")[1:]] == [
        f"recall {name}" for name in ("swde", "squad", "fda", "triviaqa", "nq", "drop")]  # the papers' order
    again = invoke("run", "-m", "tiny-gla", "-m", "tiny-gla-ccq", "-t", "recall", "--recall-dir", FIXTURES,
                   "-o", out, "--no-report")
    assert "12 skipped" in again.output
