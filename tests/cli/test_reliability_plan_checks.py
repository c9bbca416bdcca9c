"""Everything checked before a model loads, in one line naming the option, variable or path and the fix:
the cases the probes met where a run loaded the model first, ended without a word, or lost units silently
(issue 57, item 8). Each test fails if its check is removed: it asserts the refusal, and that nothing was
loaded or written."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_fakes import baseline_correct, write_sniah
from test_cli_run import RUN_ARGS, fake_world, invoke  # noqa: F401  (a fixture)
from test_reliability import assert_one_line_error

from ccq_eval import atomic_io, logs
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import shard_split, task_selection, workers
from ccq_eval.harness.options import PlanError

# The fake task (ccq_s_niah_fake, an S-NIAH task) without --samples-per-cell, which --limit conflicts with.
GRID_ARGS = ["run", "--task", "fake", "--lengths", "1k", "--depths", "0", "--model", "tiny-strong", "--quiet"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("limit", ["nan", "inf", "2.5"])
def test_a_limit_lm_eval_cannot_take_is_refused_before_the_model_loads(fake_world, limit):
    result = invoke(*GRID_ARGS, "--limit", limit, "--output", "out")
    assert_one_line_error(result, f"--limit {float(limit)}", "give a whole number of documents", "below 1")
    assert fake_world.loads == [] and not Path("out").exists()


def test_lengths_without_a_per_length_metric_are_refused_before_the_model_loads(fake_world):
    result = invoke(*GRID_ARGS, "--lengths", "100000k", "--output", "out")
    assert_one_line_error(result, "--lengths 100000k", "ccq_s_niah_fake takes 256, 512, a multiple of 1k",
                          "not 102400000 tokens", "e.g. --lengths 1k,2k,4k")
    assert fake_world.loads == [] and not Path("out").exists()


def test_perplexity_lengths_its_corpora_cannot_fill_are_refused(monkeypatch):
    monkeypatch.setattr(task_selection, "_embedded_eval_bytes", lambda: 5_000_000)
    with pytest.raises(PlanError, match=r"--lengths 1: ccq_ppl_sweep takes at least 2 tokens, not 1"):
        task_selection._check_lengths(["ccq_ppl_sweep"], [1], "1")
    with pytest.raises(PlanError, match=r"ccq_ppl_sweep takes at most 5000000 tokens .*, not 102400000"):
        task_selection._check_lengths(["ccq_ppl_sweep"], [1024, 102400000], "1k,100000k")
    task_selection._check_lengths(["ccq_ppl_sweep"], [1024, 4_000_000], "1k,4000000")


def test_a_local_rank_that_is_not_a_number_is_refused_before_the_model_loads(fake_world, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "abc")
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "LOCAL_RANK='abc' is not a whole number", "unset LOCAL_RANK")
    assert fake_world.loads == [] and not Path("out").exists()


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_worker_count_that_is_not_a_positive_number_is_refused_before_the_model_loads(fake_world, monkeypatch,
                                                                                         value):
    monkeypatch.setenv("CCQ_EVAL_WORKERS", value)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, f"CCQ_EVAL_WORKERS={value!r} is not a whole number >= 1", "unset CCQ_EVAL_WORKERS")
    assert fake_world.loads == [] and not Path("out").exists()


def test_sighup_during_a_run_is_one_line_that_says_how_to_resume(fake_world, monkeypatch):
    from ccq_eval.harness import runner

    def hung_up_while_running(plan, **kwargs):
        with workers.terminated_as_exit():  # as execute_plan runs its units
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler interrupts this

    monkeypatch.setattr(runner, "execute_plan", hung_up_while_running)
    # A suite started under nohup inherits an ignored SIGHUP, which a run rightly leaves ignored.
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    finally:
        signal.signal(signal.SIGHUP, before)
    assert_one_line_error(result, "hung up (SIGHUP", "every answered request are saved", "rerun the same command",
                          "nohup", code=128 + signal.SIGHUP)


def test_a_sighup_ignored_by_nohup_stays_ignored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with workers.terminated_as_exit():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_full_disk_names_the_file_and_leaves_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_io.os, "fsync", disk_full)
    with pytest.raises(OSError, match=rf"cannot write {target}: No space left on device; free space") as raised:
        atomic_io.atomic_write_text(target, "new")
    assert raised.value.errno == 28 and not str(raised.value).startswith("[Errno")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_full_disk_during_a_run_names_the_file(fake_world, monkeypatch):
    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_io.os, "fsync", disk_full)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, f"cannot write {Path('out') / 'tiny-strong' / 'ccq_s_niah_fake'}",
                          "No space left on device", "free space on that disk", code=1)


def test_archive_refuses_a_unit_a_live_run_holds(tmp_path):
    unit = write_sniah(tmp_path / "run", "a", baseline_correct)
    (unit / ".lock").touch()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import filelock, sys, time; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', "
        "flush=True); time.sleep(60)"), str(unit / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = invoke("archive", str(tmp_path / "run"), str(tmp_path / "archive"))
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(result, f"{unit} is being computed by a running `ccq-eval run`", "once that run has finished")
    assert not (tmp_path / "archive").exists()


def test_archive_refuses_a_run_folder_as_its_destination(tmp_path):
    write_sniah(tmp_path / "run", "a", baseline_correct)
    other = write_sniah(tmp_path / "other-run", "b", baseline_correct)
    before = snapshot(tmp_path / "other-run")
    result = invoke("archive", str(tmp_path / "run"), str(tmp_path / "other-run"))
    assert_one_line_error(result, f"{tmp_path / 'other-run'} holds a live run ({other} is not archived)",
                          "archive into a new folder")
    assert snapshot(tmp_path / "other-run") == before


def test_a_shard_split_other_than_the_folders_is_refused(fake_world):
    def plan(shard: str) -> run_plan.RunPlan:
        return run_plan.plan_run(run_plan.RunOptions(
            models=["tiny-strong", "tiny-weak"], tasks=["fake"], lengths="1k", depths="0", shard=shard,
            output=Path("out")))

    shard_split.claim_split(plan("1/2"))
    shard_split.claim_split(plan("2/2"))  # the same split, another part: taken
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--model", "tiny-weak", "--output", "out", "--shard", "2/3")
    assert_one_line_error(result, "--shard 2/3", "split its units with N = 2", str(Path("out") / ".shards.json"),
                          "2 of them are not finished", "the same command with its own K")
    assert fake_world.loads == []


def test_a_symlinked_unit_folder_is_refused_by_run_and_named_by_the_readers(fake_world, tmp_path):
    elsewhere = write_sniah(tmp_path / "elsewhere", "tiny-strong", baseline_correct)
    Path("out").mkdir()
    (Path("out") / "tiny-strong").symlink_to(elsewhere.parent)
    before = snapshot(tmp_path / "elsewhere")
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, f"{Path('out') / 'tiny-strong'} is a symbolic link", "replace the link by a copy")
    assert fake_world.loads == [] and snapshot(tmp_path / "elsewhere") == before
    result = invoke("table", "out")
    assert_one_line_error(result, f"{Path('out') / 'tiny-strong'} is a symbolic link", "readers do not follow")


@pytest.mark.parametrize(("tasks", "argument", "expected"), [
    (["s-niah-1"], "num_fewshot=3", "the config of ccq_s_niah_1 fixes num_fewshot at 0"),
    (["ppl-sweep"], "gen_kwargs=temperature=0.5", "no task of this run generates (ccq_ppl_sweep: loglikelihood"),
    (["ppl-sweep", "ppl-buckets"], "gen_kwargs=temperature=0.5", "ccq_ppl_buckets: loglikelihood_rolling"),
])
def test_an_lm_eval_arg_no_task_uses_is_refused_before_the_model_loads(tmp_path, tasks, argument, expected):
    task_args = [arg for task in tasks for arg in ("--task", task)]
    result = invoke("run", "--model", "tiny-gla", *task_args, "--lengths", "1k", "--samples-per-cell", "1",
                    "--lm-eval-arg", argument, "--output", str(tmp_path / "out"))
    assert_one_line_error(result, f"--lm-eval-arg {argument.split('=')[0]}", expected, "drop the argument")
    assert not (tmp_path / "out").exists()


def test_an_lm_eval_arg_some_task_uses_passes_the_plan():
    """gen_kwargs in a run of generation and perplexity tasks (the paper suite's smoke run): lm-eval applies it
    to the generation tasks, so the run is not refused."""
    from ccq_eval.harness.task_selection import _check_lm_eval_args_apply

    _check_lm_eval_args_apply([("ccq_s_niah_1", "s-niah-1"), ("ccq_ppl_buckets", "ppl")],
                              {"gen_kwargs": "max_gen_toks=8"})
    with pytest.raises(Exception, match="no task of this run generates"):
        _check_lm_eval_args_apply([("ccq_ppl_buckets", "ppl")], {"gen_kwargs": "max_gen_toks=8"})


def test_the_super_glue_override_warning_is_not_shown_and_others_are(capsys):
    logs.configure()
    index = logging.getLogger("lm_eval.tasks._index")
    index.warning("Task '%s' from %s overrides existing task from %s", "super-glue-t5-prompt", "/a.yaml", "/b.yaml")
    index.warning("Task '%s' from %s overrides existing task from %s", "my_task", "/a.yaml", "/b.yaml")
    printed = capsys.readouterr().err
    assert "super-glue" not in printed and "Task 'my_task' from /a.yaml overrides" in printed
