"""Planning RULER runs: --qa-dir (the QA tasks' data, recorded by content, left out with a note where a
larger name asked for them), --suite ruler's lengths, and how tasks are told a model's tokenizer.

Planning only: no model is loaded, nothing is evaluated (the tests run offline, HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import suites
from ccq_eval.harness.fingerprints import changed_since_planning
from ccq_eval.harness.model_resolution import tokenizer_metadata
from ccq_eval.harness.run_options import options_command_line
from ccq_eval.model.checkpoint import fingerprint
from ccq_eval.model.registry import ModelEntry

REPO = Path(__file__).resolve().parents[2]
QA_FIXTURES = REPO / "tests" / "fixtures" / "ruler_qa"
QA_TASKS = ["ccq_ruler_qa_squad", "ccq_ruler_qa_hotpot"]
SQUAD, HOTPOT = "dev-v2.0.json", "hotpot_dev_distractor_v1.json"


def _plan(tmp_path: Path, **options) -> run_plan.RunPlan:
    options = {"models": ["tiny-gdn"], "lengths": "1k", "output": tmp_path / "out"} | options
    return run_plan.plan_run(run_plan.RunOptions(**options))


def _qa_folder(tmp_path: Path, name: str, files: tuple[str, ...] = (SQUAD, HOTPOT)) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for file in files:
        shutil.copyfile(QA_FIXTURES / file, folder / file)
    return folder


def test_without_qa_data_the_ruler_alias_leaves_the_qa_tasks_out_in_one_note(tmp_path):
    plan = _plan(tmp_path, tasks=["ruler"])
    tasks = [unit.task for unit in plan.units]
    assert len(tasks) == 11 and not set(QA_TASKS) & set(tasks)
    (note,) = [note for note in plan.notes if "left out" in note]
    assert all(task in note for task in QA_TASKS) and "--qa-dir" in note and SQUAD in note and HOTPOT in note
    assert "\n" not in note


def test_an_unreachable_hub_leaves_the_qa_tasks_out_without_waiting_on_it(tmp_path, unreachable_hub):
    """The hub allowed (no offline variable) but unreachable: one probe, and the same one note."""
    plan = _plan(tmp_path, tasks=["ruler"])
    assert not set(QA_TASKS) & {unit.task for unit in plan.units}
    (note,) = [note for note in plan.notes if "left out" in note]
    assert "the hub cannot be reached from here" in note and "--qa-dir" in note


def test_qa_units_record_their_data_by_content_not_by_folder(tmp_path):
    first = _plan(tmp_path, tasks=["ruler-qa"], qa_dir=_qa_folder(tmp_path, "a"))
    second = _plan(tmp_path, tasks=["ruler-qa"], qa_dir=_qa_folder(tmp_path, "b"), output=tmp_path / "out2")
    assert [unit.task for unit in first.units] == QA_TASKS and not first.notes
    for unit, other in zip(first.units, second.units, strict=True):
        assert unit.spec == other.spec  # a copy of the data elsewhere asks the same question
        assert "qa_dir" not in unit.spec["task_metadata"] and str(tmp_path) not in str(unit.spec)
        assert list(unit.spec["data_files"]) == [SQUAD if unit.task.endswith("squad") else HOTPOT]
        assert unit.task_metadata["qa_dir"] == str(tmp_path / "a")  # the task reads the folder given
    assert "--qa-dir" in options_command_line(first.options)
    (tmp_path / "a" / HOTPOT).write_text("{}")  # the data changes after planning
    changed = changed_since_planning(first.units[1])
    assert changed is not None and changed.startswith(f"{HOTPOT}: planned ")
    assert changed_since_planning(first.units[0]) is None


def test_a_qa_dir_without_one_file_leaves_that_task_out_or_refuses_it(tmp_path):
    folder = _qa_folder(tmp_path, "one-file", (SQUAD,))
    plan = _plan(tmp_path, tasks=["ruler"], qa_dir=folder)
    tasks = [unit.task for unit in plan.units]
    assert "ccq_ruler_qa_squad" in tasks and "ccq_ruler_qa_hotpot" not in tasks and len(tasks) == 12
    (note,) = [note for note in plan.notes if "left out" in note]
    assert "ccq_ruler_qa_hotpot" in note and HOTPOT in note and "ccq_ruler_qa_squad" not in note
    with pytest.raises(run_plan.PlanError, match=f"ccq_ruler_qa_hotpot cannot run: --qa-dir .* lacks {HOTPOT}"):
        _plan(tmp_path, tasks=["ruler-qa"], qa_dir=folder)


@pytest.mark.parametrize(("options", "message"), [
    ({"tasks": ["ruler-qa"]}, "ccq_ruler_qa_squad and ccq_ruler_qa_hotpot cannot run: no --qa-dir holds"),
    ({"tasks": ["ruler"], "qa_dir": Path("no-such-folder")}, "--qa-dir no-such-folder: no such folder"),
    ({"suite": "ruler", "lengths": None, "tasks": ["s-niah"]}, "--suite ruler sets the tasks and lengths"),
])
def test_qa_and_suite_mistakes_are_one_line_errors(tmp_path, options, message):
    with pytest.raises(run_plan.PlanError, match=message) as error:
        _plan(tmp_path, **options)
    assert "\n" not in str(error.value)


def test_suite_ruler_runs_the_thirteen_tasks_up_to_twice_the_training_context(tmp_path, monkeypatch):
    plan = _plan(tmp_path, suite="ruler", lengths=None, qa_dir=QA_FIXTURES)
    assert len(plan.units) == 13 and not plan.notes
    assert {tuple(unit.spec["task_metadata"]["lengths"]) for unit in plan.units} == {(4096,)}  # trained at 2048
    assert {unit.spec["max_length"] for unit in plan.units} == {4096}
    offline = _plan(tmp_path, suite="ruler", lengths=None, output=tmp_path / "out2")
    assert len(offline.units) == 11 and any("left out" in note for note in offline.notes)

    part = suites.SUITES["ruler"].parts[0]
    for trained, lengths in ((None, [4096, 8192, 16384, 32768]), (1024, [2048]), (2048, [4096]),
                             (4096, [4096, 8192]), (8192, [4096, 8192, 16384]), (16384, [4096, 8192, 16384, 32768]),
                             (65536, [4096, 8192, 16384, 32768])):
        monkeypatch.setattr(suites, "training_context", lambda model, trained=trained: trained)
        assert suites.suite_lengths(part, ModelEntry("m", "m")) == lengths, trained


def test_tasks_name_a_tokenizer_by_registered_name_or_by_name_and_fingerprint(tmp_path):
    registered = run_plan.load_model_registry()["tiny-gla"]
    assert tokenizer_metadata(registered, None) == {"tokenizer": "tiny-gla", "tokenizer_name": "tiny-gla"}
    copies = []
    for name in ("a", "b"):
        folder = tmp_path / name / "tiny-gla"
        shutil.copytree(registered.source, folder)
        copies.append(tokenizer_metadata(ModelEntry("tiny-gla", str(folder)), fingerprint(folder)))
    assert copies[0]["tokenizer"] == str(tmp_path / "a" / "tiny-gla")  # what the task loads
    assert copies[0]["tokenizer_name"] == copies[1]["tokenizer_name"]  # what documents record: no path
    assert copies[0]["tokenizer_name"].startswith("tiny-gla@") and str(tmp_path) not in copies[0]["tokenizer_name"]
    hub = tokenizer_metadata(ModelEntry("org__model", "org/model"), None)
    assert hub == {"tokenizer": "org/model", "tokenizer_name": "org/model"}
    plan = _plan(tmp_path, models=["tiny-gla"], tasks=["s-niah-1"], depths="50")
    assert plan.units[0].task_metadata["tokenizer"] == "tiny-gla"
    assert "tokenizer" not in plan.units[0].spec["task_metadata"]  # not part of what the unit computes


# ------------------------------------------------------------------ task names: lm-eval's RULER port and ours
def test_lm_evals_ruler_port_names_stop_in_one_line_that_names_ours(tmp_path):
    """lm-eval's own RULER tasks (its port) are not run under their names: planning stops at once, before
    lm-eval's task index is built, with one line that names our task and lm-eval's CLI for the port."""
    from ccq_eval.harness.task_registry import ALIASES, LMEVAL_RULER_PORT

    assert set(LMEVAL_RULER_PORT) >= {"ruler_vt", "niah_single_1", "niah_multikey_3", "ruler_qa_hotpot", "longcxt"}
    for name, ours in LMEVAL_RULER_PORT.items():
        with pytest.raises(run_plan.PlanError) as error:
            _plan(tmp_path, tasks=["s-niah-1", name])
        message = str(error.value)
        assert "\n" not in message and f"'{name}' is lm-eval's own port of RULER" in message, message
        assert f"ours is {ours}" in message and f"--tasks {name}" in message
        targets = ALIASES[ours][0] if ours in ALIASES else (ours,)
        assert len(targets) > 1 or targets[0] in message  # a single task's lm-eval name as well


def test_run_names_ours_for_ruler_vt_on_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from ccq_eval import cli

    result = CliRunner().invoke(cli.app, ["run", "-m", "tiny-gdn", "-t", "ruler_vt", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "ours is ruler-vt (ccq_ruler_vt)" in result.output
    assert not (tmp_path / "out").exists()


def test_run_and_inspect_take_the_same_task_names(tmp_path):
    """Every name `inspect --task` takes, `run --task` takes for the same task (niah-multikey-1 included)."""
    from ccq_eval.harness.task_registry import RegistryTaskCatalog
    from ccq_eval.inspection.prompts import VARIANT_FOLDERS, resolve_task

    catalog = RegistryTaskCatalog()  # what planning resolves --task through
    for variant in VARIANT_FOLDERS:
        for name in (variant.replace("_", "-"), f"ccq_{variant}"):
            assert resolve_task(name) == variant, name
            assert catalog.resolve(name) == [f"ccq_{variant}"], name
    plan = _plan(tmp_path, tasks=["niah-multikey-1"], depths="50")
    assert [unit.task for unit in plan.units] == ["ccq_niah_multikey_1"]
