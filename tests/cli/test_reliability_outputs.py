"""Fault injection, round two (issue 29, cases 8-14): what the readers show and what archive writes.

Each test breaks one thing (a non-finite result, a folder of several runs, samples of other
documents, a name with markdown in it, a bad option, a prompt budget of a few tokens, an archive
over another run's archive) and checks the one-line error or the correct output, and that the stored
units are byte for byte what they were.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from test_cli_fakes import (
    SNIAH_TASK,
    baseline_correct,
    revouch,
    variant_correct,
    write_sniah,
)
from test_cli_run import RUN_ARGS, TASK_NAME, TASK_UTILS, fake_world, invoke  # noqa: F401  (a fixture)
from test_reliability import assert_one_line_error, finished_run, snapshot

from ccq_eval import atomic_io
from ccq_eval.harness import store

# 8 -------------------------------------------------------------------------------------------

# The fake task's score, NaN where tiny-weak loses the needle at 2K (depths 0 and 50), as a perplexity is
# NaN when one weight is.
NAN_SCORE = TASK_UTILS.replace('    value = 100.0 * (doc["value"] in results[0])\n',
                               '    value = 100.0 * (doc["value"] in results[0])\n'
                               '    if "forgot" in results[0] and doc["length"] == 2048'
                               ' and doc["depth"] != 100:\n'
                               '        value = float("nan")\n')


def test_non_finite_result_is_a_failure_shown_in_every_table(fake_world):
    assert 'float("nan")' in NAN_SCORE
    Path("tasks/fake_utils.py").write_text(NAN_SCORE)
    run = [*RUN_ARGS, "--model", "tiny-strong", "--model", "tiny-weak", "--output", "out"]
    stopped = invoke(*run[:-2], "--output", "stopped")
    line = assert_one_line_error(stopped, "non-finite result of tiny-weak", f"{TASK_NAME} acc = nan",
                                 "look for NaN / inf weights", code=1)
    assert "tiny-strong" not in line
    result = invoke(*run, "--keep-going")
    assert result.exit_code == 1, result.output
    assert "failed: tiny-weak" in result.output
    assert "1 evaluated" in result.output and "1 failed" in result.output
    stored = snapshot(Path("out"))
    weak_row = [row for row in markdown_rows(Path("out/table.md").read_text()) if "tiny-weak" in row]
    assert weak_row == [["S-NIAH-fake", "tiny-weak", "66.67", "NaN (failed)"]]
    assert "non-finite value" in Path("out/table.md").read_text()
    again = invoke(*run)  # the stored failure stays one on a rerun
    assert again.exit_code == 1 and "1 failed" in again.output
    assert "2 skipped (already finished)" in again.output
    tidy = invoke("table", "out", "--view", "tidy")
    assert tidy.exit_code == 0 and "non-finite value" in tidy.output
    assert "| tiny-weak | ccq_s_niah_fake | 2048 | - | - | acc | none | NaN (failed) |" in tidy.output
    assert "tiny-weak,ccq_s_niah_fake,s-niah,2048,,,acc,none,NaN (failed)," in invoke(
        "table", "out", "--view", "tidy", "--format", "csv").output
    compared = invoke("compare", "out", "--baseline", "tiny-strong", "--variant", "tiny-weak")
    assert compared.exit_code == 0, compared.output
    row_2k = next(row for row in markdown_rows(compared.output) if row[1] == "2048")
    # columns 9 and 10: p (Holm), p (raw); 11: the verdict
    assert row_2k[5:9] == ["NaN (failed)", "NaN (failed)", "-", "-"] and row_2k[11] == "failed"
    assert "non-finite value" in compared.output
    assert invoke("report", "out").exit_code == 0
    page = Path("out/report.html").read_text()
    assert "NaN (failed)" in page and "failed unit: non-finite result of tiny-weak" in page
    assert snapshot(Path("out")) == stored


# 9 -------------------------------------------------------------------------------------------


def test_compare_on_a_folder_of_several_runs_names_them(tmp_path):
    for run in ("reference", "gpu-grid"):
        write_sniah(tmp_path / run, "tiny-gla", baseline_correct)
        variant = variant_correct if run == "reference" else baseline_correct
        write_sniah(tmp_path / run, "tiny-gla-ccq", variant)
    before = snapshot(tmp_path)
    for command in (["compare", str(tmp_path)], ["table", str(tmp_path)], ["report", str(tmp_path)]):
        line = assert_one_line_error(invoke(*command), "holds 2 result folders", str(tmp_path / "gpu-grid"),
                                     str(tmp_path / "reference"), "point the command at one result folder")
        assert SNIAH_TASK in line
    result = invoke("compare", str(tmp_path / "reference"))  # one of them: compared as before
    assert result.exit_code == 0, result.output
    assert snapshot(tmp_path) == before


# 10 ------------------------------------------------------------------------------------------


def test_samples_of_other_documents_are_never_paired(fake_world, monkeypatch):
    from test_cli_run import REGISTRY

    from ccq_eval.harness import plan as run_plan
    from ccq_eval.model import registry as model_registry

    twin = model_registry.ModelEntry("tiny-strong-ccq", "/nonexistent/tiny-strong-ccq", "the CCQ twin")
    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: dict(REGISTRY, **{twin.name: twin}))
    for model, seed, output in (("tiny-strong", "0", "mixed"), ("tiny-strong-ccq", "1", "mixed"),
                                ("tiny-strong", "0", "same"), ("tiny-strong-ccq", "0", "same")):
        result = invoke(*RUN_ARGS, "--model", model, "--seed", seed, "--output", output, "--no-report")
        assert result.exit_code == 0, result.output
    before = snapshot(Path("mixed"))
    assert_one_line_error(invoke("compare", "mixed"),
                          f"'tiny-strong' and 'tiny-strong-ccq' share no document of {TASK_NAME} (their "
                          "settings differ: seed 0 vs 1", "run both models with the same --seed")
    assert invoke("report", "mixed").exit_code == 0
    page = Path("mixed/report.html").read_text()
    assert "share no document" in page and 'class="comparison"' not in page
    assert snapshot(Path("mixed")) == before
    same = invoke("compare", "same", "--format", "csv")  # the same documents: paired by their hash
    assert same.exit_code == 0, same.output
    rows = list(csv.DictReader(io.StringIO(same.output)))
    assert {row["pairing"] for row in rows} == {"doc_hash"} and {row["unpaired"] for row in rows} == {"0"}


# 11 ------------------------------------------------------------------------------------------


def markdown_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in `text`, split where a markdown reader splits (at `|`
    not escaped by a backslash)."""
    import re

    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            for line in text.splitlines() if line.startswith("|")]


def test_markdown_escapes_pipes_and_html_in_names(tmp_path):
    write_sniah(tmp_path / "out", "gla|100.00", lambda length, depth, index: False)
    write_sniah(tmp_path / "out", "<img src=x onerror=alert(1)>", baseline_correct)
    before = snapshot(tmp_path)
    for view in ("paper", "tidy"):
        result = invoke("table", str(tmp_path / "out"), "--view", view)
        assert result.exit_code == 0, result.output
        rows = markdown_rows(result.output)
        assert len({len(row) for row in rows}) == 1, rows  # no row has a cell more than its header
        assert "<img" not in result.output and "&lt;img src=x onerror=alert(1)&gt;" in result.output
        header = rows[0]
        for row in rows[2:]:
            if row[header.index("model")] == "gla\\|100.00" and view == "paper":
                assert row[header.index("1K")] == "0.00" and row[header.index("2K")] == "0.00"
    paper = invoke("table", str(tmp_path / "out")).output
    assert any(row[1] == "gla\\|100.00" for row in markdown_rows(paper))
    compared = invoke("compare", str(tmp_path / "out"), "--baseline", "gla|100.00", "--variant",
                      "<img src=x onerror=alert(1)>")
    assert compared.exit_code == 0, compared.output
    assert "### &lt;img src=x onerror=alert(1)&gt; vs gla\\|100.00" in compared.output
    assert len({len(row) for row in markdown_rows(compared.output)}) == 1
    assert snapshot(tmp_path) == before


# 12 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf"])
def test_inspect_baseline_lambda_follows_the_ccq_attach_rule(tmp_path, monkeypatch, value):
    from ccq_eval.inspection import run as inspect_run

    monkeypatch.setattr(inspect_run, "inspect_model", lambda *a, **k: pytest.fail("a model was read"))
    earlier = tmp_path / "inspect"
    earlier.mkdir()
    (earlier / "reads.csv").write_text("model,length\ntiny-gla,1024\n")
    result = invoke("inspect", "-m", "tiny-gla", "--baseline-lambda", value, "-o", str(earlier))
    line = assert_one_line_error(result, f"--baseline-lambda {float(value):g} must be a finite number >= 0",
                                 "e.g. --baseline-lambda 2")
    attach = invoke("run", "-m", "tiny-gla", "--ccq-attach", f"lambda={value}", "-o", str(tmp_path / "run"))
    attach_line = assert_one_line_error(attach, f"--ccq-attach: lambda '{value}' must be a finite number")

    def rule(message: str) -> str:
        return message.partition(" must ")[2].split("; e.g.")[0]

    assert rule(line) == rule(attach_line)
    assert [p.name for p in earlier.iterdir()] == ["reads.csv"] and not (tmp_path / "run").exists()


# 14 ------------------------------------------------------------------------------------------


def test_archive_never_replaces_another_runs_archive(fake_world):
    finished_run("src")
    assert invoke("archive", "src", "packed").exit_code == 0
    packed = snapshot(Path("packed"))
    assert invoke("archive", "src", "packed").exit_code == 0  # an archive of the same run: refreshed
    assert snapshot(Path("packed")) == packed
    finished_run("other")  # the same unit, evaluated again: another run
    result = invoke("archive", "other", "packed")
    assert_one_line_error(result, "holds an archive of another run", "nothing was replaced",
                          "archive into a new folder")
    assert snapshot(Path("packed")) == packed


def test_a_run_into_an_archive_takes_its_units_as_finished(fake_world):
    """An archive's units (results.json.xz) are finished units: a run into its folder evaluates only what
    the archive lacks, and leaves every archived file as it was."""
    finished_run("src")
    assert invoke("archive", "src", "packed").exit_code == 0
    archived = snapshot(Path("packed"))
    archived_files = sorted(p for p in Path("packed").rglob("*") if p.is_file() and "tiny-strong" in p.parts)
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS[:-1], "--model", "tiny-strong", "--model", "tiny-weak", "--output", "packed")
    assert result.exit_code == 0, result.output
    assert "2 units (2 models, 1 task), 1 already finished" in result.output
    assert [Path(load).name for load in fake_world.loads] == ["tiny-weak"]  # the archived model is not loaded
    assert sorted(p for p in Path("packed").rglob("*") if p.is_file() and "tiny-strong" in p.parts) == archived_files
    assert all(Path(path).read_bytes() == data for path, data in archived.items())
    assert store.unit_dir(Path("packed"), "tiny-weak", TASK_NAME).results.is_file()
    table = invoke("table", "packed", "--format", "csv")
    assert table.exit_code == 0, table.output
    assert "tiny-strong" in table.output and "tiny-weak" in table.output


def test_archive_to_a_file_is_refused_in_one_line(fake_world):
    finished_run("src")
    Path("afile").write_text("not a folder")
    for destination in ("afile", "afile/sub"):
        assert_one_line_error(invoke("archive", "src", destination), "afile is a file, not a folder",
                              "nothing was written")
    assert Path("afile").read_text() == "not a folder"


def test_archive_of_truncated_samples_writes_nothing(fake_world):
    finished_run("src")
    finished_run("src", "--model", "tiny-weak")
    samples = store.unit_dir(Path("src"), "tiny-weak", TASK_NAME).samples(TASK_NAME)
    samples.write_text("".join(samples.read_text().splitlines(keepends=True)[:-2]))
    before = snapshot(Path("src"))
    result = invoke("archive", "src", "packed")
    assert_one_line_error(result, str(samples), "samples but results.json records")
    assert "archived" not in result.output and not Path("packed").exists()
    assert snapshot(Path("src")) == before


# 13 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [2, 3, 4, 5, 6, 7, 9])
def test_middle_truncation_of_chinese_at_a_budget_of_a_few_tokens(budget):
    import torch
    from adapter_support import byte_tokenizer, tiny_model
    from ccq_eval.tasks.longbench import utils as longbench

    from ccq_eval.harness.adapter import CCQEvalLM

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "longbench" / "multifieldqa_zh.jsonl"
    record = json.loads(fixture.read_text(encoding="utf-8").splitlines()[0])
    prompt = longbench.doc_to_text(record | {"ccq_dataset": "multifieldqa_zh"})
    assert prompt.startswith("阅读") and prompt.endswith("回答：")  # 3-byte characters at both ends
    tokenizer = byte_tokenizer()
    adapter = CCQEvalLM(model=tiny_model(tokenizer, dtype=torch.float32), tokenizer=tokenizer, max_length=68)
    ids = adapter.tok_encode(prompt)
    kept = adapter.truncator.fit(ids, budget, "middle", "ccq_longbench_multifieldqa_zh", f"a {budget}-token budget")
    text = tokenizer.decode(kept, skip_special_tokens=False)
    assert adapter.tok_encode(text) == kept and len(kept) <= budget  # whole characters only
    half = budget // 2
    assert len(kept) == 3 * (half // 3) * 2  # as many whole 3-byte characters as a half holds, at each end
    assert prompt.startswith(text[: len(text) // 2]) and prompt.endswith(text[len(text) // 2:])


# Unclear messages ----------------------------------------------------------------------------


def test_full_disk_on_resume_keeps_the_cache_and_says_so(fake_world, monkeypatch):
    import sqlite3

    from test_cli_run import N_DOCS

    fake_world.fail_after = 7
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 1
    database = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).responses_db
    kept = database.read_bytes()
    connect = sqlite3.connect

    class FullDisk:
        """A connection on a full disk: reads work, the first write fails as sqlite's does."""

        def __init__(self, *args, **kwargs):
            self._conn = connect(*args, **kwargs)

        def execute(self, sql, *args):
            if sql.lstrip().upper().startswith(("CREATE", "DELETE", "INSERT")):
                raise sqlite3.OperationalError("database or disk is full")
            return self._conn.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self._conn, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._conn.__exit__(*exc)

    monkeypatch.setattr(store.response_cache.sqlite3, "connect", FullDisk)
    fake_world.fail_after, fake_world.calls[:] = None, []
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    fragments = ("database or disk is full", "the answers it holds are kept", "free disk space")
    line = assert_one_line_error(result, f"cannot write the resume cache {database}", *fragments, code=1)
    assert "delete" not in line and "corrupt" not in line
    assert database.read_bytes() == kept and fake_world.calls == []
    monkeypatch.setattr(store.response_cache.sqlite3, "connect", connect)
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    assert len(fake_world.calls) == N_DOCS - 7  # the kept answers were used


def test_fractional_limit_is_rounded_up_as_lm_eval_does(tmp_path):
    from test_cli_fakes import write_longbench

    for model in ("tiny-gla", "tiny-gla-ccq"):  # --limit 0.3 of 4 records: lm-eval evaluates ceil(1.2) = 2
        (unit,) = write_longbench(tmp_path / "out", model, {"qasper": [10.0, 30.0]})
        results = json.loads((unit / "results.json").read_text())
        results["n-samples"]["ccq_longbench_qasper"]["original"] = 4
        results["config"]["limit"] = 0.3
        (unit / "results.json").write_text(json.dumps(results))
        revouch(unit)
    before = snapshot(tmp_path)
    for command in ("table", "compare"):
        result = invoke(command, str(tmp_path / "out"))
        assert result.exit_code == 0, result.output
    assert snapshot(tmp_path) == before


def test_a_write_cut_short_leaves_no_stale_lm_eval_copy(fake_world, monkeypatch):
    write_json = atomic_io.atomic_write_json

    def killed_before_results(path, obj):
        if Path(path).name == store.RESULTS_FILE:
            raise KeyboardInterrupt  # killed between the tracker copies and results.json
        write_json(path, obj)

    monkeypatch.setattr(atomic_io, "atomic_write_json", killed_before_results)
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 130
    monkeypatch.setattr(atomic_io, "atomic_write_json", write_json)
    tracker = Path("out/lm_eval/tiny-strong")
    assert len(list(tracker.glob("results_*.json"))) == 1
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    (copy,) = tracker.glob("results_*.json")  # the rerun's copy replaced the stale one
    assert len(list(tracker.glob("samples_*.jsonl"))) == 1
    stale = tracker / "results_2000-01-01T00-00-00.json"  # one left by an earlier version: the newest counts
    stale.write_text(copy.read_text())
    before = snapshot(Path("out"))
    tables = [invoke("table", path, "--view", "tidy") for path in ("out", "out/lm_eval")]
    assert all(result.exit_code == 0 for result in tables), tables[1].output
    assert markdown_rows(tables[0].output)[2:] and "tiny-strong" in tables[1].output
    assert snapshot(Path("out")) == before


@pytest.mark.parametrize(("args", "environment", "fragments"), [
    (["--seed", "-1"], {}, ["--seed -1 is out of range", "from 0 to 4294967295"]),
    (["--seed", str(2**64)], {}, [f"--seed {2**64} is out of range"]),
    ([], {"WORLD_SIZE": "abc"},
     ["environment variable WORLD_SIZE='abc' is not a whole number", "unset WORLD_SIZE"]),
    ([], {"RANK": "abc"}, ["environment variable RANK='abc'", "unset RANK"]),
    ([], {"RANK": "1"}, ["RANK=1 and WORLD_SIZE=1", "unset RANK WORLD_SIZE"]),
    (["--device", "bogus"], {}, ["--device 'bogus' is not a device", "auto, cpu, cuda or cuda:N"]),
    (["--device", "cuda"], {}, ["--device cuda: torch sees no CUDA device", "use --device cpu"]),
])
def test_bad_seed_device_and_launcher_variables_fail_before_any_model_loads(fake_world, monkeypatch, args,
                                                                           environment, fragments):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    finished = finished_run("out") if not environment else None  # the launcher check comes first
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", *args, "--output", "out")
    assert_one_line_error(result, *fragments)
    assert fake_world.loads == ([] if finished is None else ["/nonexistent/tiny-strong"])
    assert finished is None or snapshot(Path("out")) == finished


def test_a_bad_device_form_is_named_before_the_models_are_resolved(fake_world):
    """A typo in --device is the error even when the model would fail to resolve too: it is an option's
    form, checked with the other options before any registry or checkpoint is read."""
    result = invoke(*RUN_ARGS, "--model", "no-such-model", "--device", "cuda0", "--output", "out")
    assert_one_line_error(result, "--device 'cuda0' is not a device", "auto, cpu, cuda or cuda:N")
    assert fake_world.loads == [] and not Path("out").exists()


@pytest.mark.parametrize(("args", "fragments"), [
    (["table", "out", "--digits", "-3"], ["--digits -3: give a number of decimals from 0 to 15"]),
    (["table", "out", "-o", ""], ["--output is empty"]),
    (["table", "out", "-o", "out"], ["--output out is a folder; give the path of a file"]),
    (["compare", "out", "-o", ""], ["--output is empty"]),
    (["report", "out", "-o", "out"], ["--output out is a folder; give the path of the HTML file"]),
    (["report", "out", "-o", "afile/report.html"], ["afile is a file, not a folder"]),
    (["figures", "out", "-o", "afile"], ["afile is a file, not a folder; give a folder for the figures"]),
    (["figures", "out", "-o", ""], ["--output is empty"]),
    (["run", "--model", "tiny-strong", "-o", ""], ["--output is empty"]),
])
def test_bad_output_options_are_one_line_errors(fake_world, args, fragments):
    write_sniah(Path("out"), "tiny-gla", baseline_correct)
    write_sniah(Path("out"), "tiny-gla-ccq", variant_correct)
    Path("afile").write_text("not a folder")
    before = snapshot(Path("."))
    assert_one_line_error(invoke(*args), *fragments)
    assert snapshot(Path(".")) == before and Path("afile").read_text() == "not a folder"
    assert not list(Path(".").glob("*.html")) and not Path("figures").exists()


def test_broken_results_file_and_registry_entry_are_named(fake_world, tmp_path):
    from ccq_eval.model import registry as model_registry

    finished_run("out")
    results = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME).results
    results.write_text('{"results": {"x": 5}}')
    assert_one_line_error(invoke("table", "out"), str(results), "results.x should map metric names to values")
    registry = tmp_path / "registry.json"
    registry.write_text('{"m": {"description": "no path"}}')
    with pytest.raises(model_registry.RegistryError, match="model 'm' has no \"path\"; give its checkpoint"):
        model_registry.load_model_registry(registry)
    registry.write_text('[{"path": "somewhere"}]')
    with pytest.raises(model_registry.RegistryError, match="model entry 1 has no \"name\""):
        model_registry.load_model_registry(registry)


def test_shard_on_an_empty_folder_counts_no_unit_as_finished(fake_world):
    models = ["--model", "tiny-strong", "--model", "tiny-weak"]
    result = invoke(*RUN_ARGS, *models, "--shard", "1/2", "-o", "out")
    assert result.exit_code == 0, result.output
    assert "2 units (2 models, 1 task), 0 already finished" in result.output
    assert "1 to run here" in result.output


def test_no_git_noise_outside_a_repository(fake_world, capfd):
    from lm_eval import evaluator

    lookup = evaluator.get_git_commit_hash
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--model", "tiny-weak", "--output", "out")
    assert result.exit_code == 0 and "not a git repository" not in capfd.readouterr().err
    assert evaluator.get_git_commit_hash is lookup  # the run looks git up itself: lm-eval left as it is


def test_a_closed_stdout_ends_the_command_quietly(tmp_path):
    import subprocess
    import sys

    command = subprocess.Popen([sys.executable, "-m", "ccq_eval", "tasks"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=tmp_path)
    command.stdout.close()  # `ccq-eval tasks | head -0`: the reader is gone before the first line
    errors = command.stderr.read().decode()
    command.wait()
    assert errors == "" and command.returncode == 1  # no BrokenPipeError line, no traceback


@pytest.mark.parametrize(("argument", "fragment"), [
    ("apply_chat_template=true", "no chat template support"),
    ("fewshot_as_multiturn=true", "needs a chat template"),
    ("check_integrity=true", "runs lm-eval's own task tests"),
])
def test_lm_eval_arguments_the_adapter_cannot_honour_are_refused(fake_world, argument, fragment):
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--lm-eval-arg", argument, "--output", "out")
    assert_one_line_error(result, f"--lm-eval-arg {argument}: ", fragment, "leave it out")
    assert fake_world.loads == [] and not Path("out").exists()
    plain = invoke(*RUN_ARGS, "--model", "tiny-strong", "--lm-eval-arg", argument.replace("true", "false"),
                   "--output", "out")
    assert plain.exit_code == 0, plain.output


def test_sniah_tokenizer_by_registered_name_never_asks_the_hub(monkeypatch):
    import transformers
    from ccq_eval.tasks.s_niah import utils as sniah

    asked = []
    real = transformers.AutoTokenizer.from_pretrained

    def recording(name, **kwargs):
        asked.append((str(name), kwargs.get("local_files_only")))
        return real(name, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    assert sniah.load_tokenizer("tiny-gla").encode("ab", add_special_tokens=False) == [100, 101]  # ByT5 bytes
    with pytest.raises(sniah.SNiahError, match="could not load tokenizer 'no-such-model' offline") as error:
        sniah.load_tokenizer("no-such-model")
    assert "\n" not in str(error.value)
    assert asked[0][0].endswith("tiny-gla") and asked[0][0] != "tiny-gla"  # the registered checkpoint folder
    assert asked == [(asked[0][0], True), ("no-such-model", True)]  # no hub id: never looked up there


def test_tokenizer_of_a_gla_folder_loads_without_a_model_type_warning(capfd):
    from ccq_eval.tasks.ppl import utils as ppl
    from ccq_eval.tasks.s_niah import utils as sniah

    capfd.readouterr()
    sniah.load_tokenizer("tiny-gla")  # config.json says model_type gla, which transformers does not know
    ppl._tokenizer_by_name.cache_clear()  # loaded afresh, not taken from an earlier test's cache
    ppl.get_tokenizer({"tokenizer": "tiny-gdn"})
    assert "to instantiate a model of type" not in capfd.readouterr().err


def test_finished_unit_keeps_no_resume_cache_and_compare_says_not_significant(fake_world):
    models = ["--model", "tiny-strong", "--model", "tiny-other"]
    assert invoke(*RUN_ARGS, *models, "--output", "out").exit_code == 0
    assert not list(Path("out").rglob("responses.sqlite*"))  # the README: it exists while the unit runs
    result = invoke("compare", "out", "--baseline", "tiny-strong", "--variant", "tiny-other", "-f", "csv")
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert rows and {row["verdict"] for row in rows} == {"not significant"}  # the same answers: no difference


def test_perplexity_without_samples_per_cell_says_it_scores_every_document(fake_world, monkeypatch):
    from test_cli_run import FakeCatalog

    from ccq_eval.harness import plan as run_plan

    class Perplexity(FakeCatalog):
        def resolve(self, name):
            return ["ccq_ppl_sweep"]

    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: Perplexity(Path(".")))
    options = dict(models=["tiny-strong"], tasks=["ppl"], lengths="1k", output=Path("out"))
    plan = run_plan.plan_run(run_plan.RunOptions(**options))
    note = "ccq_ppl_sweep without --samples-per-cell scores every document"
    assert any(note in line for line in plan.notes)
    quick = run_plan.plan_run(run_plan.RunOptions(**options, samples_per_cell=4))
    assert not any("--samples-per-cell" in note for note in quick.notes)


def test_edited_checkpoint_names_the_file_that_changed(fake_world, tmp_path):
    from test_reliability import make_checkpoint

    folder = make_checkpoint(tmp_path / "ckpt", 1.0)
    assert invoke(*RUN_ARGS, "--model", str(folder), "--output", "out").exit_code == 0
    before = snapshot(Path("out"))
    make_checkpoint(folder, 2.0)  # new weights, the same config.json
    line = assert_one_line_error(invoke(*RUN_ARGS, "--model", str(folder), "--output", "out"),
                                 "different settings (checkpoint: stored {'sha256': {'model.safetensors': '")
    assert "config.json" not in line
    assert snapshot(Path("out")) == before


def test_help_at_80_columns_shows_every_option_name_whole():
    from typer.testing import CliRunner

    from ccq_eval import cli

    output = CliRunner().invoke(cli.app, ["run", "--help"], env={"COLUMNS": "80"}).output
    names = ("--samples-per-cell", "--no-cuda-graphs", "--lm-eval-arg", "--longbench-dir", "--ccq-attach")
    for name in names:
        assert name in output, name
    assert "…" not in output and max(len(line) for line in output.splitlines()) <= 80


# Progress bars (off unless `run --progress`) and the first run's output: a fresh `ccq-eval` process is
# needed, as the switches are read when tqdm is imported (tests/cli/test_cli_conventions.py).


def test_ccq_attach_prints_no_newly_initialized_report(capfd):
    import logging

    from ccq_eval.model.loading import load_model

    level = logging.getLogger("transformers").level
    model, _ = load_model("tiny-gla", device="cpu", dtype="float32", ccq_lambda=1.0, ccq_fields={})
    errors = capfd.readouterr().err
    assert "MISSING" not in errors and "newly initialized" not in errors
    assert model.config.ccq and logging.getLogger("transformers").level == level  # the level is given back
