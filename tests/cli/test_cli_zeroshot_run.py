"""`ccq-eval run` on the zero-shot suite: the alias and --suite, --zeroshot-dir (data recorded by content),
wikitext's protocol in the unit's identity (--rolling-windows), the one-line stop without data, and the
CLI's wikitext number equal to lm-eval HFLM's protocol by default. Offline, on tests/fixtures/zeroshot."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness.run_options import options_command_line
from ccq_eval.task_families import ZEROSHOT_TASKS

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "zeroshot"


def invoke(*args: str):
    return CliRunner().invoke(cli.app, [str(arg) for arg in args])


def _plan(tmp_path: Path, **options) -> run_plan.RunPlan:
    options = {"models": ["tiny-gla"], "tasks": ["zeroshot"], "output": tmp_path / "out"} | options
    return run_plan.plan_run(run_plan.RunOptions(**options))


def _copy_fixtures(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURES, tmp_path / name))


@pytest.fixture
def no_hub_data(monkeypatch):
    """The hub unreachable and nothing in the datasets cache, as `datasets` reports it offline."""
    import datasets

    def unreachable(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)


def test_tasks_lists_the_alias_and_the_suite():
    result = invoke("tasks")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(line.split()[:1] == ["zeroshot"] for line in lines)  # the alias
    assert any("--suite zeroshot" in line or line.strip().startswith("zeroshot") for line in lines)
    assert "social_iqa" in result.output


def test_units_record_the_data_by_content_and_wikitext_by_protocol(tmp_path):
    first = _plan(tmp_path, zeroshot_dir=_copy_fixtures(tmp_path, "a"))
    second = _plan(tmp_path, zeroshot_dir=_copy_fixtures(tmp_path, "b"), output=tmp_path / "out2")
    assert [unit.task for unit in first.units] == list(ZEROSHOT_TASKS) and not first.notes
    for unit, other in zip(first.units, second.units, strict=True):
        assert unit.spec == other.spec  # the same data elsewhere asks the same question
        assert str(tmp_path) not in json.dumps(unit.spec)
        files = sorted((tmp_path / "a" / unit.task).glob("*.jsonl"))
        assert unit.spec["data_files"] == {f"{unit.task}/{path.name}": hashlib.sha256(path.read_bytes()).hexdigest()
                                           for path in files}
        assert unit.spec.get("rolling_windows") == ("hflm" if unit.task == "wikitext" else None)
        assert unit.task_metadata["zeroshot_dir"] == str(tmp_path / "a")
    carried = _plan(tmp_path, tasks=["wikitext", "piqa"], zeroshot_dir=FIXTURES, rolling_windows="carry",
                    output=tmp_path / "out3")
    assert [unit.spec.get("rolling_windows") for unit in carried.units] == ["carry", None]
    command = " ".join(options_command_line(carried.options))
    assert f"--zeroshot-dir {FIXTURES} --rolling-windows carry" in command


def test_without_data_the_run_stops_with_one_line(tmp_path, no_hub_data):
    result = invoke("run", "-m", "tiny-gla", "-t", "zeroshot", "-o", tmp_path / "out")
    assert result.exit_code != 0
    message = result.output.strip()
    assert "\n" not in message, message
    assert "task wikitext: dataset EleutherAI/wikitext_document_level (wikitext-2-raw-v1) is neither" in message
    assert "datasets.load_dataset('EleutherAI/wikitext_document_level', 'wikitext-2-raw-v1')" in message
    assert not (tmp_path / "out").exists()  # nothing written before the data is there


def test_a_folder_without_one_task_stops_on_that_task(tmp_path, no_hub_data):
    folder = _copy_fixtures(tmp_path, "a")
    shutil.rmtree(folder / "copa")
    expected = r"^task copa: dataset aps/super_glue \(copa\) is neither.*--zeroshot-dir FOLDER holding copa/validation"
    with pytest.raises(run_plan.PlanError, match=expected):
        _plan(tmp_path, zeroshot_dir=folder)


def test_suite_paper_leaves_out_what_has_no_data_in_one_note(tmp_path, no_hub_data):
    folder = _copy_fixtures(tmp_path, "a")
    for task in ("piqa", "boolq"):
        shutil.rmtree(folder / task)
    plan = _plan(tmp_path, tasks=[], suite="paper", zeroshot_dir=folder)
    zeroshot_units = [unit.task for unit in plan.units if unit.task in ZEROSHOT_TASKS]
    assert zeroshot_units == [task for task in ZEROSHOT_TASKS if task not in ("piqa", "boolq")]
    (note,) = [note for note in plan.notes if "zeroshot-dir" in note]
    assert note.startswith("--suite paper: piqa, boolq skipped (--zeroshot-dir ") and "\n" not in note
    plan = _plan(tmp_path, tasks=[], suite="zeroshot", zeroshot_dir=FIXTURES, output=tmp_path / "out2")
    assert [unit.task for unit in plan.units] == list(ZEROSHOT_TASKS)


@pytest.mark.parametrize("options, message", [
    ({"tasks": ["piqa"], "rolling_windows": "carry"}, "--rolling-windows sets how the zero-shot suite scores wikitext"),
    ({"rolling_windows": "windows"}, "--rolling-windows 'windows': valid choices are hflm, carry"),
    ({"zeroshot_dir": "/nonexistent/zeroshot"}, "--zeroshot-dir /nonexistent/zeroshot: no such folder"),
])
def test_option_mistakes_are_one_line_errors(tmp_path, options, message):
    with pytest.raises(run_plan.PlanError, match=message.replace("(", r"\(")):
        _plan(tmp_path, **({"zeroshot_dir": FIXTURES} | options))


@pytest.mark.slow
def test_a_finished_unit_moves_with_its_data_and_keeps_its_protocol(tmp_path):
    folder = _copy_fixtures(tmp_path, "a")
    out = tmp_path / "out"
    result = invoke("run", "-m", "tiny-gla", "-t", "wikitext", "-t", "copa", "--zeroshot-dir", folder, "-o", out,
                    "--no-report")
    assert result.exit_code == 0, result.output
    moved = _plan(tmp_path, tasks=["wikitext", "copa"], zeroshot_dir=_copy_fixtures(tmp_path, "b"), output=out)
    assert all(unit.finished for unit in moved.units)
    with pytest.raises(run_plan.PlanError, match=r"\(rolling_windows: stored 'hflm', asked 'carry'"):
        _plan(tmp_path, tasks=["wikitext"], zeroshot_dir=folder, rolling_windows="carry", output=out)
    (folder / "copa" / "validation.jsonl").write_text((FIXTURES / "copa" / "validation.jsonl").read_text()[:-200])
    with pytest.raises(run_plan.PlanError, match=r"different settings \(data_files: stored \{'copa/validation.jsonl'"):
        _plan(tmp_path, tasks=["copa"], zeroshot_dir=folder, output=out)
    results = json.loads(next((out / "tiny-gla" / "wikitext").glob("results*.json")).read_text())
    assert results["config"]["ccq_scoring"]["rolling_protocol_by_task"] == {"wikitext": "hflm"}


@pytest.mark.slow
def test_the_runs_wikitext_number_is_hflms_by_default(tmp_path):
    """The CLI's default protocol for wikitext is lm-eval HFLM's (disjoint windows of its max_length, each read
    afresh): on tiny-transformer, equal to lm_eval.simple_evaluate with HFLM on the same fixture."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from ccq_eval.harness import zeroshot
    from ccq_eval.harness.task_registry import make_task_manager
    from ccq_eval.model.loading import load_model

    out = tmp_path / "out"
    result = invoke("run", "-m", "tiny-transformer", "-t", "wikitext", "--zeroshot-dir", FIXTURES, "-o", out,
                    "--no-report", "--device", "cpu")
    assert result.exit_code == 0, result.output
    ours = json.loads(next((out / "tiny-transformer" / "wikitext").glob("results*.json")).read_text())["results"]

    model, tokenizer = load_model("tiny-transformer", device="cpu", dtype="float32")
    manager = make_task_manager()
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, add_bos_token=False)
    reference = simple_evaluate(model=hflm, tasks=zeroshot.task_specs(manager, ["wikitext"], FIXTURES),
                                task_manager=manager, bootstrap_iters=0)["results"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["wikitext"][metric] == pytest.approx(reference["wikitext"][metric], rel=1e-5), metric
