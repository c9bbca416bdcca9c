"""A ccq-eval run as lm-eval's tools see it: each unit also stored as lm-eval's EvaluationTracker
stores results (found by lm-eval's own file readers), and lm-eval's W&B logger fed per unit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import lm_eval.loggers
import pytest
from lm_eval.utils import (
    get_file_task_name,
    get_latest_filename,
    get_results_filenames,
    get_sample_results_filenames,
)
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import runner, store
from ccq_eval.model.registry import ModelEntry

TASKS = ("fake_a", "fake_b")


class Catalog:
    def aliases(self):
        return {"fake": "two fake tasks"}

    def resolve(self, name):
        return list(TASKS)

    def make_task_manager(self, metadata):
        return None


def evaluate(unit, context):
    samples = [{"doc_id": i, "doc": {"i": i}, "target": "x", "resps": [["x"]], "filtered_resps": ["x"],
                "acc": float(i % 2)} for i in range(3)]
    results = {"results": {unit.task: {"alias": unit.task, "acc,none": 1 / 3}},
               "configs": {unit.task: {"task": unit.task}}, "versions": {unit.task: 1}, "n-shot": {unit.task: 0},
               "higher_is_better": {unit.task: {"acc": True}}, "config": {"model": unit.model}}
    return runner.UnitOutcome(results=results, samples={unit.task: samples})


@pytest.fixture
def fake_run(tmp_path, monkeypatch):
    monkeypatch.setattr(run_plan, "load_model_registry",
                        lambda *a, **k: {"m": ModelEntry(name="m", source=str(tmp_path / "never-loaded"))})
    monkeypatch.setattr(run_plan, "default_task_catalog", Catalog)
    monkeypatch.setattr(runner, "default_evaluator", lambda: evaluate)
    output = tmp_path / "out"

    def run(*extra):
        args = ["run", "-m", "m", "-t", "fake", "-o", str(output), "--quiet", "--no-report", "--lengths", "1k",
                *extra]
        return CliRunner().invoke(cli.app, args)

    return output, run


def test_lm_eval_readers_find_the_results_of_a_run(fake_run):
    output, run = fake_run
    result = run()
    assert result.exit_code == 0, result.output
    files = [str(p) for p in (output / "lm_eval").rglob("*") if p.is_file()]
    results_files = get_results_filenames(files)
    assert len(results_files) == len(TASKS)
    found = {}
    for name in results_files:
        stored = json.loads(Path(name).read_text(encoding="utf-8"))
        [task] = stored["results"]
        found[task] = stored
        ours = json.loads((output / "m" / task / "results.json").read_text(encoding="utf-8"))
        assert stored == ours | {store.TRACKER_UNIT_KEY: f"m/{task}"}  # the copy names its unit
    assert set(found) == set(TASKS)
    latest = json.loads(Path(get_latest_filename(results_files)).read_text(encoding="utf-8"))
    assert set(latest["results"]) <= set(TASKS)

    sample_files = get_sample_results_filenames(files)
    assert sorted(get_file_task_name(Path(f).name) for f in sample_files) == sorted(TASKS)
    for name in sample_files:
        task = get_file_task_name(Path(name).name)
        assert Path(name).read_bytes() == (output / "m" / task / f"samples_{task}.jsonl").read_bytes()

    # ccq-eval's own readers count each unit once, from the run folder or from lm_eval/ alone
    assert sorted(u.results_path.name for u in store.load_results(output)) == ["results.json"] * 2
    assert len(store.load_results(output / "lm_eval")) == len(TASKS)


def test_wandb_args_reach_lm_eval_wandb_logger_per_unit(fake_run, monkeypatch):
    output, run = fake_run
    calls = []

    class FakeRun:
        def finish(self):
            calls.append(("finish",))

    class FakeWandbLogger:
        def __init__(self, init_args=None, config_args=None):
            calls.append(("init", init_args, config_args))
            self.run = FakeRun()

        def post_init(self, results):
            calls.append(("post_init", sorted(results["results"])))

        def log_eval_result(self):
            calls.append(("result",))

        def log_eval_samples(self, samples):
            calls.append(("samples", sorted(samples)))

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "wandb" else real_find_spec(name, *a))
    monkeypatch.setattr(lm_eval.loggers, "WandbLogger", FakeWandbLogger)
    result = run("--lm-eval-arg", "wandb_args=project=ccq,job_type=eval", "--lm-eval-arg",
                 "wandb_config_args=note=x")
    assert result.exit_code == 0, result.output
    inits = [c for c in calls if c[0] == "init"]
    assert inits == [("init", {"name": f"m/{task}", "project": "ccq", "job_type": "eval"}, {"note": "x"})
                     for task in TASKS]
    assert [c for c in calls if c[0] == "samples"] == [("samples", [task]) for task in TASKS]
    assert calls.count(("finish",)) == len(TASKS)
    # the logger settings are not part of what a unit computes: a rerun without them finds the units done
    spec = json.loads((output / "m" / "fake_a" / "unit.json").read_text(encoding="utf-8"))
    assert spec["lm_eval_args"] == {}
    again = run()
    assert again.exit_code == 0 and "2 skipped" in again.output


def test_wandb_args_without_wandb_installed_fail_before_any_unit(fake_run, monkeypatch):
    output, run = fake_run
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    result = run("--lm-eval-arg", "wandb_args=project=ccq")
    assert result.exit_code == 2 and "pip install wandb" in result.output
    assert not output.exists()
