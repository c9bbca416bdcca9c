"""`ccq-eval tasks` and `ccq-eval models`: what can be run, with one-line descriptions."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import plan as run_plan
from ccq_eval.model import registry as model_registry


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_tasks_lists_aliases_with_descriptions():
    result = invoke("tasks")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for alias in ("s-niah", "s-niah-1", "s-niah-2", "s-niah-3", "ppl", "longbench", "longbench-e"):
        assert alias in lines, result.output
        assert len(lines[alias].split(None, 1)[1]) > 10  # a description follows the name


def test_task_aliases_resolve_to_our_lm_eval_tasks():
    catalog = run_plan.default_task_catalog()
    assert catalog.resolve("s-niah") == ["ccq_s_niah_1", "ccq_s_niah_2", "ccq_s_niah_3"]
    assert catalog.resolve("ppl") == ["ccq_ppl_buckets", "ccq_ppl_sweep"]
    assert "ccq_longbench_qasper" in catalog.resolve("longbench")


def test_models_lists_registry_entries(tmp_path, monkeypatch):
    models_dir = tmp_path / "models"
    (models_dir / "tiny-gla").mkdir(parents=True)
    registry = {
        "tiny-gla": {"path": "tiny-gla", "description": "GLA, 2 layers, byte tokenizer", "default": True},
        "tiny-gla-ccq": {"path": "tiny-gla-ccq", "description": "the same with CCQ", "default": True},
        "big-gla": {"path": "big-gla", "description": "not run by default"},
    }
    (models_dir / "registry.json").write_text(json.dumps(registry))
    monkeypatch.setattr(model_registry, "MODEL_REGISTRY_PATH", models_dir / "registry.json")
    result = invoke("models")
    assert result.exit_code == 0, result.output
    assert "tiny-gla      GLA, 2 layers, byte tokenizer (default)" in result.output
    assert "big-gla       not run by default\n" in result.output
    entries = run_plan.load_model_registry()
    assert entries["tiny-gla"].source == str((models_dir / "tiny-gla").resolve())
    assert model_registry.default_model_names(entries) == ["tiny-gla", "tiny-gla-ccq"]


def test_models_without_registry_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(model_registry, "MODEL_REGISTRY_PATH", tmp_path / "registry.json")
    result = invoke("models")
    assert result.exit_code == 1 and "no models registered" in result.output


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("run", "table", "compare", "figures", "tasks", "models"):
        assert command in result.output
