"""A unit's identity covers the task's definition as loaded (its YAML, hooks and files beside them) and
the package versions: a rerun with a changed task definition never takes the finished unit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import task_registry
from ccq_eval.harness.task_identity import task_definition

TASK = "ccq_s_niah_1"


@pytest.fixture
def tasks_copy(tmp_path, monkeypatch):
    """A copy of the installed task folders, loaded instead of them (CCQ_EVAL_TASKS_DIR)."""
    copy = tmp_path / "tasks"
    shutil.copytree(task_registry.tasks_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    task_registry._our_index.cache_clear()
    monkeypatch.setenv("CCQ_EVAL_TASKS_DIR", str(copy))
    yield copy
    task_registry._our_index.cache_clear()


def _shorten_answers(tasks: Path) -> None:
    template = tasks / "s_niah" / "_s_niah_template_yaml"
    template.write_text(template.read_text().replace("max_gen_toks: 128", "max_gen_toks: 2"))


def test_task_definition_follows_the_content_of_the_task_folder(tasks_copy, monkeypatch):
    copied = task_definition(TASK)
    monkeypatch.delenv("CCQ_EVAL_TASKS_DIR")
    task_registry._our_index.cache_clear()
    installed = task_definition(TASK)
    assert copied == installed is not None  # an unchanged copy defines the same task
    _shorten_answers(tasks_copy)
    monkeypatch.setenv("CCQ_EVAL_TASKS_DIR", str(tasks_copy))
    task_registry._our_index.cache_clear()
    assert task_definition(TASK) != installed
    assert task_definition("hellaswag") is None  # lm-eval's own: its version is in the spec


def test_a_ruler_task_follows_the_s_niah_module_it_builds_prompts_with(tasks_copy):
    """RULER's families import S-NIAH's construction module: an edit there changes their definition too."""
    before = {task: task_definition(task) for task in ("ccq_niah_multikey_1", "ccq_ruler_vt", "ccq_ppl_sweep")}
    construction = tasks_copy / "s_niah" / "construction.py"
    construction.write_text(construction.read_text() + "\n# an edit\n")
    after = {task: task_definition(task) for task in before}
    assert after["ccq_niah_multikey_1"] != before["ccq_niah_multikey_1"]
    assert after["ccq_ruler_vt"] != before["ccq_ruler_vt"]
    assert after["ccq_ppl_sweep"] == before["ccq_ppl_sweep"]  # perplexity imports nothing of S-NIAH's


def _finish(plan: run_plan.RunPlan) -> None:
    """Store each planned unit as finished, as a run would (unit.json, samples, meta, results, record)."""
    for unit in plan.units:
        plan.store.open(unit.dir, unit.spec).close()
        plan.store.commit(unit.dir, unit.model, {"results": {unit.task: {"acc,none": 50.0}}}, {unit.task: []},
                          {"model": unit.model, "spec": unit.spec})


def test_a_changed_task_definition_does_not_reuse_the_finished_unit(tasks_copy, tmp_path):
    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=[TASK], lengths="1k", output=tmp_path / "out")
    first = run_plan.plan_run(options)
    assert set(first.units[0].spec["versions"]) == {"ccq-eval", "lm_eval"}
    _finish(first)
    assert run_plan.plan_run(options).units[0].finished  # the same definition: taken
    _shorten_answers(tasks_copy)
    with pytest.raises(run_plan.PlanError, match=r"different settings \(task_definition: stored '"):
        run_plan.plan_run(options)


def test_a_unit_stored_before_the_definition_was_recorded_is_taken_with_a_note(tmp_path):
    import json

    from ccq_eval.harness.store import vouch

    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=[TASK], lengths="1k", output=tmp_path / "out")
    plan = run_plan.plan_run(options)
    _finish(plan)
    unit = plan.units[0].dir
    older = {key: value for key, value in plan.units[0].spec.items() if key not in ("task_definition", "versions")}
    unit.spec.write_text(json.dumps(dict(older, format=2)))  # as format 2 wrote it: no record either
    unit.meta.write_text(json.dumps({"format": 2, "model": "tiny-gdn", "spec": older}))
    (unit.path / vouch.CHECKSUMS_FILE).unlink()
    again = run_plan.plan_run(options)
    assert again.units[0].finished
    assert [note for note in again.notes if "did not record the task definition" in note] == [
        f"1 finished unit ({unit.path}) stored by an older ccq-eval that did not record the task definition "
        "and versions: taken as stored (delete a unit's folder to redo it with this version)"]


def test_a_unit_moved_with_its_data_stays_valid_and_changed_data_does_not(tmp_path):
    data, out = tmp_path / "a" / "longbench", tmp_path / "a" / "out"
    data.mkdir(parents=True)
    (data / "qasper.jsonl").write_text('{"input": "q", "context": "c", "answers": ["x"], "length": 10}\n')
    task = "ccq_longbench_qasper"
    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=[task], longbench_dir=data, output=out)
    _finish(run_plan.plan_run(options))
    moved = tmp_path / "b"
    (tmp_path / "a").rename(moved)  # the results and the data, moved together
    again = run_plan.RunOptions(models=["tiny-gdn"], tasks=[task], longbench_dir=moved / "longbench",
                                output=moved / "out")
    assert run_plan.plan_run(again).units[0].finished
    (moved / "longbench" / "qasper.jsonl").write_text('{"input": "other"}\n')
    with pytest.raises(run_plan.PlanError, match="data_files"):
        run_plan.plan_run(again)


@pytest.fixture
def corpora_copy(tmp_path, monkeypatch):
    """A copy of the embedded corpora, read instead of the installed ones (an editable install's, to edit)."""
    from ccq_eval.data import corpora

    copy = tmp_path / "corpora"
    copy.mkdir()
    for file, _description in corpora.CORPORA.values():
        shutil.copy(corpora.DATA_DIR / file, copy / file)
    monkeypatch.setattr(corpora, "DATA_DIR", copy)
    return copy


def test_units_of_tasks_that_read_the_embedded_corpora_record_them(corpora_copy, tmp_path):
    from ccq_eval.harness.fingerprints import embedded_corpora_fingerprint

    tasks = [TASK, "ccq_ppl_sweep", "ccq_longbench_qasper"]
    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=tasks, lengths="1k", output=tmp_path / "out",
                                  longbench_dir=Path(__file__).resolve().parents[1] / "fixtures" / "longbench")
    specs = {unit.task: unit.spec for unit in run_plan.plan_run(options).units}
    recorded = embedded_corpora_fingerprint()
    assert sorted(recorded) == ["austen.jsonl.xz", "kjv.jsonl.xz", "sotu.jsonl.xz"]
    assert specs[TASK]["embedded_corpora"] == specs["ccq_ppl_sweep"]["embedded_corpora"] == recorded
    assert "embedded_corpora" not in specs["ccq_longbench_qasper"]  # LongBench reads its own data files only
    (corpora_copy / "sotu.jsonl.xz").write_bytes(b"edited")
    assert embedded_corpora_fingerprint()["sotu.jsonl.xz"] != recorded["sotu.jsonl.xz"]


def test_an_edited_corpus_makes_the_rerun_redo_the_units_that_read_it(corpora_copy, tmp_path):
    tasks = [TASK, "ccq_longbench_qasper"]
    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=tasks, lengths="1k", output=tmp_path / "out",
                                  longbench_dir=Path(__file__).resolve().parents[1] / "fixtures" / "longbench")
    _finish(run_plan.plan_run(options))
    assert all(unit.finished for unit in run_plan.plan_run(options).units)  # unchanged corpora: taken
    (corpora_copy / "kjv.jsonl.xz").write_bytes((corpora_copy / "kjv.jsonl.xz").read_bytes() + b"\0")
    again = run_plan.plan_run(options)
    units = {unit.task: unit for unit in again.units}
    assert not units[TASK].finished and units[TASK].corpora_changed == ["kjv.jsonl.xz"]
    assert units["ccq_longbench_qasper"].finished  # reads no corpus: kept
    assert [note for note in again.notes if "embedded corpora that changed" in note] == [
        f"1 finished unit ({units[TASK].dir.path}) read embedded corpora that changed since they were stored "
        "(kjv.jsonl.xz): computed again; their stored results stay until the new ones replace them"]


def test_a_corpus_edited_after_planning_is_not_stored(corpora_copy, tmp_path):
    from ccq_eval.harness.fingerprints import changed_since_planning

    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=[TASK], lengths="1k", output=tmp_path / "out")
    (unit,) = run_plan.plan_run(options).units
    assert changed_since_planning(unit) is None
    (corpora_copy / "austen.jsonl.xz").write_bytes(b"edited while the unit ran")
    assert changed_since_planning(unit).startswith("austen.jsonl.xz: planned ")


def test_a_unit_stored_before_the_corpora_were_recorded_is_taken_with_a_note(tmp_path):
    import json

    from ccq_eval.harness.store import vouch

    options = run_plan.RunOptions(models=["tiny-gdn"], tasks=[TASK], lengths="1k", output=tmp_path / "out")
    plan = run_plan.plan_run(options)
    _finish(plan)
    unit = plan.units[0].dir
    older = {key: value for key, value in plan.units[0].spec.items() if key != "embedded_corpora"}
    unit.spec.write_text(json.dumps(dict(older, format=3)))  # as format 3 wrote it
    unit.meta.write_text(json.dumps({"format": 3, "model": "tiny-gdn", "spec": older}))
    vouch.write_record(unit.path, older)
    again = run_plan.plan_run(options)
    assert again.units[0].finished and again.units[0].corpora_assumed
    assert [note for note in again.notes if "before the embedded corpora" in note] == [
        f"1 finished unit ({unit.path}) stored before the embedded corpora a unit reads were recorded: taken as "
        "stored (delete a unit's folder to redo it with this installation's corpora)"]
