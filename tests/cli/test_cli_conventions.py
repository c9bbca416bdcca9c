"""Command-line conventions: --version from the package metadata, --verbosity, choices in --help,
read-only commands without torch or fla, each warning once per run."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval import logs

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "results" / "reference"


def invoke(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def test_version_comes_from_the_package_metadata():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"ccq-eval {importlib.metadata.version('ccq-eval')}"


def _help(*command) -> str:
    """--help of a command, wide enough that no choice list wraps, without whitespace, lower-case."""
    output = CliRunner().invoke(cli.app, [*command, "--help"], env={"COLUMNS": "240"}).output
    return "".join(output.split()).lower()


def test_help_lists_the_choices_of_choice_options():
    table_help = _help("table")
    assert "markdown|csv|latex" in table_help and "paper|tidy" in table_help
    assert "-o" in table_help and "--output" in table_help
    assert "--verbosity" in _help() and "debug|info|warning|error|critical" in _help()
    assert "--output" in _help("figures") and "--out<" not in _help("figures")
    assert "float32|fp32|bfloat16" in _help("run")


def test_verbosity_sets_the_level_of_ccq_eval_and_lm_eval_loggers(tmp_path):
    result = invoke("--verbosity", "ERROR", "table", tmp_path / "empty")
    assert result.exit_code != 0  # no results there; the option itself was accepted
    assert logging.getLogger("lm_eval").level == logging.ERROR
    assert logging.getLogger("ccq_eval").level == logging.ERROR
    result = invoke("--verbosity", "LOUD", "tasks")
    assert result.exit_code == 2 and "LOUD" in result.output


def test_read_only_commands_import_neither_torch_nor_fla(tmp_path):
    """`import ccq_eval` and the commands that read results stay off torch and fla (seconds each on a
    2-core machine instead of 10-20)."""
    script = f"""
import sys
import ccq_eval
assert not {{"torch", "fla"}} & set(sys.modules), "import ccq_eval loaded torch or fla"
from typer.testing import CliRunner
from ccq_eval import cli
reference = {str(REFERENCE)!r}
compare = ["compare", reference, "--baseline", "tiny-gla", "--variant", "tiny-gla-ccq", "--n-boot", "200"]
figures = ["figures", reference, "-o", {str(tmp_path)!r}]
report = ["report", reference, "-o", {str(tmp_path / "report.html")!r}]
for args in (["tasks"], ["models"], ["table", reference], compare, figures, report):
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, (args, result.output)
loaded = sorted(m for m in ("torch", "fla", "triton") if m in sys.modules)
print(loaded)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_each_warning_shape_passes_once_and_the_metadata_hint_can_be_dropped():
    once = logs.OncePerRun()
    logger = logging.getLogger("lm_eval.test_conventions")

    def passes(message, level=logging.WARNING):
        return once.filter(logger.makeRecord(logger.name, level, __file__, 1, message, (), None))

    first = "[ccq_ppl_sweep] Metrics were not scored on the same number of documents (a=3, b=4)."
    again = "[ccq_ppl_buckets] Metrics were not scored on the same number of documents (a=8, b=2)."
    assert passes(first) and not passes(again) and not passes(first)
    hint = "ccq_s_niah_1: Custom kwargs can be passed to `--metadata` in console (as json string)"
    assert passes(hint) and not passes(hint.replace("ccq_s_niah_1", "ccq_s_niah_2"))
    assert passes("some other warning")
    assert passes("an info line", logging.INFO) and passes("an info line", logging.INFO)
    dropping = logs.OncePerRun(drop_metadata_hint=True)
    record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, hint, (), None)
    assert not dropping.filter(record)


def test_run_drops_lm_eval_metadata_hint_and_repeats(tmp_path, monkeypatch):
    """A run whose units log lm-eval's per-task warnings shows each once (fake units, no model)."""
    from ccq_eval.harness import plan as run_plan
    from ccq_eval.harness import runner
    from ccq_eval.model.registry import ModelEntry

    class Catalog:
        def aliases(self):
            return {"fake": "a fake task"}

        def resolve(self, name):
            return ["fake_a", "fake_b"]

        def make_task_manager(self, metadata):
            return None

    def evaluate(unit, context):
        for task in ("fake_a", "fake_b"):
            logging.getLogger("lm_eval.api.task").warning(
                "%s: Custom kwargs can be passed to `--metadata` in console (as json string)", task)
            logging.getLogger("lm_eval.evaluator_utils").warning(
                "[%s] Metrics were not scored on the same number of documents (x=1, y=2).", task)
        results = {"results": {unit.task: {"acc,none": 1.0}}, "configs": {unit.task: {}}, "config": {}}
        return runner.UnitOutcome(results=results, samples={unit.task: []})

    monkeypatch.setattr(run_plan, "load_model_registry",
                        lambda *a, **k: {"m": ModelEntry(name="m", source=str(tmp_path / "never-loaded"))})
    monkeypatch.setattr(run_plan, "default_task_catalog", Catalog)
    monkeypatch.setattr(runner, "default_evaluator", lambda: evaluate)
    args = ["run", "-m", "m", "-t", "fake", "-o", str(tmp_path / "out"), "--quiet", "--no-report",
            "--lengths", "1k"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "Custom kwargs" not in result.output
    assert result.output.count("Metrics were not scored on the same number of documents") == 1
    assert json.loads((tmp_path / "out" / "m" / "fake_a" / "results.json").read_text())["results"]
