"""Command-line conventions: --version from the package metadata, --verbosity, choices in --help,
read-only commands without torch or fla, each warning once per run."""

from __future__ import annotations

import importlib.metadata
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from ccq_eval import cli, logs

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


@pytest.mark.slow  # a fresh Python process runs six read-only commands on the reference results
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
    _fake_run(tmp_path, monkeypatch, warn=True)
    args = ["run", "-m", "m", "-t", "fake", "-o", str(tmp_path / "out"), "--quiet", "--no-report",
            "--lengths", "1k"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "Custom kwargs" not in result.output
    assert result.output.count("Metrics were not scored on the same number of documents") == 1
    assert json.loads((tmp_path / "out" / "m" / "fake_a" / "results.json").read_text())["results"]


def _fake_run(tmp_path, monkeypatch, warn: bool):
    """A registry of one model and a task alias of two fake tasks; each unit's evaluation logs lm-eval's
    per-task warnings when `warn`."""
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
        for task in ("fake_a", "fake_b") if warn else ():
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


def test_run_prints_one_line_per_unit_and_a_summary(tmp_path, monkeypatch):
    """The default run's stderr: the plan, a line per unit as it ends, the summary; a unit found finished by
    another worker has no line of its own (the summary counts it)."""
    _fake_run(tmp_path, monkeypatch, warn=False)
    args = ["run", "-m", "m", "-t", "fake", "-o", str(tmp_path / "out"), "--no-report", "--lengths", "1k"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) == 4, result.output
    assert lines[0].startswith("2 units (1 model, 2 tasks)")
    assert sorted(line.split(" (")[0] for line in lines[1:3]) == ["done: m / fake_a", "done: m / fake_b"]
    assert lines[3].startswith("done: 2 evaluated, 0 skipped")


def test_library_messages_a_user_cannot_act_on_are_dropped():
    """After logs.configure: fla's CPU-fallback warning and transformers' notes on fla's cache naming are
    not shown; other warnings and records are, and our tasks' per-length metrics note only for ours."""
    import warnings

    logs.configure("WARNING")

    def shown(logger_name, message):
        logger = logging.getLogger(logger_name)
        return bool(logger.filter(logger.makeRecord(logger_name, logging.WARNING, __file__, 1, message, (), None)))

    assert not shown("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated. Use `cache`.")
    assert shown("transformers.utils.generic", "some other transformers warning")
    note = "[{}] Metrics were not scored on the same number of documents (acc,none=2, acc_1024,none=1)."
    assert not shown("lm_eval.evaluator_utils", note.format("ccq_s_niah_1"))
    assert shown("lm_eval.evaluator_utils", note.format("their_task"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a plain interpreter shows
        logs.ignore_unactionable_warnings()
        warnings.warn("Triton is not supported on current platform, roll back to CPU.", UserWarning, stacklevel=1)
        warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0", FutureWarning,
                      stacklevel=1)
        warnings.warn("a warning a user can act on", UserWarning, stacklevel=1)
    assert [str(warning.message) for warning in caught] == ["a warning a user can act on"]


def test_helper_units_reach_the_command_reporter_once(capsys):
    """Units a helper process finished are relayed to the command's reporter as they arrive; the line
    reporter and the rich progress bar show a unit once, whether they hear of it from the helper or the
    command's process finds it done."""
    import queue
    from dataclasses import dataclass

    from ccq_eval.harness import reporting, workers

    @dataclass
    class Dir:
        path: Path

    @dataclass
    class FakeUnit:
        model: str
        task: str
        dir: Dir

    class Ended:
        def __init__(self):
            self.ended = []

        def unit_end(self, unit, status, detail=""):
            self.ended.append((unit.model, unit.task, status, detail))

    class Exited:
        def is_alive(self):
            return False

        def join(self):
            pass

    unit = FakeUnit("m", "t", Dir(Path("results") / "m" / "t"))
    messages = queue.Queue()
    messages.put(("unit", str(unit.dir.path), "done", "1.5 s"))
    messages.put(("finished", 0, [str(unit.dir.path)]))
    reporter = Ended()
    helpers = workers.Helpers([Exited()], messages, {str(unit.dir.path): unit}, reporter)
    assert helpers.finish(wait=True) == {unit.dir.path}
    assert reporter.ended == [("m", "t", "done", "1.5 s")]

    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    rich = reporting.RichReporter(console)
    rich.run_start(SimpleNamespace(units=[unit], pending=[unit]))
    rich.unit_end(unit, "done", "1.5 s")
    rich.unit_end(unit, reporting.DONE_ELSEWHERE)
    rich.run_end()
    assert rich.progress.tasks[0].completed == 1
    assert reporting.DONE_ELSEWHERE not in console.file.getvalue()

    lines = reporting.LineReporter()
    lines.unit_end(unit, "done", "1.5 s")
    lines.unit_end(unit, reporting.DONE_ELSEWHERE)
    assert capsys.readouterr().err == "done: m / t (1.5 s)\n"


def _fresh_run(tmp_path, *args):
    """`ccq-eval run ARGS` in a fresh process, as a shell starts it (an in-process run of another test may
    have set the progress-bar switches in this one's environment); its stderr."""
    environment = {name: value for name, value in os.environ.items() if name not in logs.PROGRESS_BAR_SWITCHES}
    done = subprocess.run([sys.executable, "-m", "ccq_eval", "run", "-m", "tiny-gla", "--lengths", "1k", "--depths",
                           "50", "--samples-per-cell", "1", "--workers", "1", "--no-report", *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


@pytest.mark.slow
def test_first_run_prints_a_line_per_unit_and_no_library_noise(tmp_path):
    """A run with an embedded model prints the plan, one line per unit and the summary: no warning of fla,
    transformers or torch, no progress bar; `--progress` shows the bars."""
    stderr = _fresh_run(tmp_path, "-t", "s-niah-1", "-t", "ppl-sweep", "-o", "plain")
    lines = stderr.splitlines()
    assert len(lines) == 4, stderr
    assert lines[0].startswith("2 units (1 model, 2 tasks), 0 already finished")
    assert [line.split(" (")[0] for line in lines[1:3]] == ["done: tiny-gla / ccq_s_niah_1",
                                                             "done: tiny-gla / ccq_ppl_sweep"]
    assert lines[3].startswith("done: 2 evaluated, 0 skipped (already finished), 0 failed")
    with_bars = _fresh_run(tmp_path, "-t", "s-niah-1", "-o", "bars", "--progress")
    assert "it/s]" in with_bars and "ETA" in with_bars  # lm-eval's / transformers' bars and ours


def test_a_users_error_no_command_handles_is_its_message_alone(capsys):
    """A UserError is what was wrong and what to do: one line, exit 1, no pointer to a traceback (that is
    for anything else, which keeps its type name)."""
    import typer

    from ccq_eval.cli.errors import one_line_errors
    from ccq_eval.errors import UserError

    @one_line_errors
    def users_error():
        raise UserError("the folder x has no config.json;\n pass a checkpoint folder")

    @one_line_errors
    def bug():
        raise KeyError("x")

    for command, code, line in ((users_error, 1, "Error: the folder x has no config.json; pass a checkpoint folder"),
                                (bug, 1, "Error: KeyError: 'x' (CCQ_EVAL_DEBUG=1 shows the traceback")):
        with pytest.raises(typer.Exit) as ended:
            command()
        assert ended.value.exit_code == code
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and error.startswith(line), error
