"""Processes: SIGTERM ends a run as Ctrl-C does (its helpers are stopped), a helper whose command's process
is gone ends too, and a stale data-parallel launch environment is refused instead of waiting forever."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
from test_cli_run import RUN_ARGS, fake_world, invoke  # noqa: F401  (a fixture)
from test_reliability import assert_one_line_error

from ccq_eval.harness import workers


def test_sigterm_ends_the_run_block_as_an_exit_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ended, workers.terminated_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
    assert ended.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_during_a_run_is_one_line_that_says_how_to_resume(fake_world, monkeypatch):
    from ccq_eval.harness import runner

    def terminated_while_running(plan, **kwargs):
        with workers.terminated_as_exit():  # as execute_plan runs its units
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts this

    monkeypatch.setattr(runner, "execute_plan", terminated_while_running)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "terminated (SIGTERM)", "every answered request are saved",
                          "rerun the same command to resume", code=128 + signal.SIGTERM)


def test_a_process_forked_in_the_run_block_is_ended_by_sigterm_as_without_it():
    """lm-eval's bootstrap pool forks workers inside the run and stops them with SIGTERM: they must die of
    the signal (a SystemExit raised in a pool worker holding the pool's locks can hang the run)."""
    with workers.terminated_as_exit():
        child = os.fork()
        if child == 0:  # the child: wait to be terminated
            time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        os.kill(child, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status


def test_a_process_forked_in_the_run_block_starts_with_the_default_sigterm_action():
    """The default action, not a Python handler: a Python handler only flags the signal, so a pool worker that
    blocks on the pool's lock after the flag is set never acts on it, and Pool.terminate() waits on it."""
    with workers.terminated_as_exit():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        child = os.fork()
        if child == 0:
            os._exit(0 if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else 1)
        _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_helper_whose_parent_is_gone_exits():
    process = multiprocessing.get_context("spawn").Process(target=workers._exit_with_parent, args=(-1,))
    process.start()  # its parent is not -1: as if the command's process had died
    process.join(timeout=60)
    assert process.exitcode == 1


@pytest.mark.parametrize("environment", [{"WORLD_SIZE": "2"}, {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "x"}])
def test_a_stale_launch_environment_is_refused(fake_world, monkeypatch, environment):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "WORLD_SIZE=2", "LOCAL_RANK", "is not set", "unset RANK WORLD_SIZE")
