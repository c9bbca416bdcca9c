"""Fault injection, round two (issue 29, cases 1-7): a unit's identity is everything that decides its
numbers (the weights actually loaded, the config, the data files, the settings, the seed), and every
reader and every waiting worker checks it.

Each test breaks one part of that identity and checks the clear one-line error (or the correct result)
and that no stored result changed. The runs use test_cli_run's fake world (the real
lm_eval.simple_evaluate, a fake model), the loading cases the embedded tiny checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from test_cli_run import RUN_ARGS, TASK_NAME, fake_world, invoke  # noqa: F401
from test_reliability import assert_one_line_error, finished_run, snapshot

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import results_store, runner

# 1 -------------------------------------------------------------------------------------------


def test_waiting_worker_refuses_a_unit_another_finished_with_other_settings(fake_world, monkeypatch):
    """Worker B (--seed 5) plans while the folder is empty; worker A (--seed 0) finishes the unit before
    B takes its lock. B must not count A's unit as its own."""
    plan_run = run_plan.plan_run
    stored: dict[str, bytes] = {}

    def plan_then_other_worker_finishes(options):
        mine = plan_run(options)
        runner.execute_plan(plan_run(dataclasses.replace(options, seed=0)))
        stored.update(snapshot(Path("out")))
        return mine

    monkeypatch.setattr(run_plan, "plan_run", plan_then_other_worker_finishes)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "5", "--output", "out")
    line = assert_one_line_error(result, "holds a run with different settings (task_metadata:", "'seed': 0",
                                 "'seed': 5", "use another --output", code=1)
    assert "another worker" not in line
    assert stored and snapshot(Path("out")) == stored


def test_waiting_worker_accepts_a_unit_another_finished_with_the_same_settings(fake_world, monkeypatch):
    plan_run = run_plan.plan_run

    def plan_then_other_worker_finishes(options):
        mine = plan_run(options)
        runner.execute_plan(plan_run(options))
        return mine

    monkeypatch.setattr(run_plan, "plan_run", plan_then_other_worker_finishes)
    calls = len(fake_world.calls)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "5", "--output", "out")
    assert result.exit_code == 0, result.output
    assert "1 finished by another worker" in result.output
    assert len(fake_world.calls) - calls == 12  # computed once, by the other worker


# 6 -------------------------------------------------------------------------------------------


def test_finished_unit_without_unit_json_is_matched_by_its_meta(fake_world):
    finished_run("out")
    unit = results_store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    unit.spec.unlink()
    before = snapshot(Path("out"))
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "3", "--output", "out")
    assert_one_line_error(result, str(unit.path), "different settings (task_metadata:", "'seed': 3",
                          "use another --output")
    assert fake_world.loads == [] and snapshot(Path("out")) == before
    same = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")  # the same question: finished
    assert same.exit_code == 0 and "1 already finished" in same.output, same.output
    assert snapshot(Path("out")) == before


def test_finished_unit_with_no_record_of_its_settings_is_refused(fake_world):
    finished_run("out")
    unit = results_store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    unit.spec.unlink()
    meta = json.loads(unit.meta.read_text())
    del meta["spec"]
    unit.meta.write_text(json.dumps(meta))
    before = snapshot(Path("out"))
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "3", "--output", "out")
    assert_one_line_error(result, str(unit.path), "neither unit.json nor meta.json records its settings",
                          "use another --output, or delete that folder")
    assert fake_world.loads == [] and snapshot(Path("out")) == before


# 5 -------------------------------------------------------------------------------------------


def test_deleted_model_folder_does_not_come_back_from_the_tracker_copies(fake_world):
    import shutil

    finished_run("out", "--model", "tiny-weak")
    assert len(list(Path("out/lm_eval").glob("*/results_*.json"))) == 2
    shutil.rmtree("out/tiny-weak")
    before = snapshot(Path("out"))
    table = invoke("table", "out", "--view", "tidy", "--format", "csv")
    assert table.exit_code == 0, table.output
    assert "tiny-strong" in table.output and "tiny-weak" not in table.output
    compare = invoke("compare", "out", "--baseline", "tiny-strong", "--variant", "tiny-weak")
    assert compare.exit_code != 0 and "tiny-weak" in compare.output, compare.output
    shutil.rmtree("out/tiny-strong")  # no unit folder left: the copies name their units
    assert_one_line_error(invoke("table", "out"), "holds no results")
    assert snapshot(Path("out")) == {path: data for path, data in before.items() if "tiny-strong" not in path
                                     or "lm_eval" in path}
    lm_eval_layout = invoke("table", "out/lm_eval", "--view", "tidy", "--format", "csv")  # asked for by name
    assert lm_eval_layout.exit_code == 0 and "tiny-weak" in lm_eval_layout.output, lm_eval_layout.output
