"""Helper processes that share one plan with the command's own process (`ccq-eval run --workers N`).

A CPU evaluation of the small models runs one torch thread per process (runner.cpu_threads: more threads
per process slow it down), so one process leaves the other cores idle. Helpers run the same plan; every
unit is taken under its lock (store.unit_lock.UnitLock), so each is computed once, by whichever process gets
to it first, and stored exactly as the command's own process would store it. Each helper sends back the
units it finished, as it finishes each (the command's reporter prints its line) and as it exits (the
command's summary counts them as evaluated here, not as done by another worker).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness.options import workers_override
from ccq_eval.harness.reporting import Reporter, SilentReporter


def auto_workers(plan: run_plan.RunPlan, threads_per_worker: int) -> int:
    """Processes for "auto": on a CPU, as many as the usable cores hold at `threads_per_worker` threads
    each, at most one per pending unit; one on a GPU and under a data-parallel launch (one device, and
    torchrun's ranks already split each unit). CCQ_EVAL_WORKERS overrides it."""
    override = workers_override()
    if override is not None:
        return override
    if plan.device != "cpu" or run_plan.environment_int("WORLD_SIZE", 1) > 1:
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable // max(1, threads_per_worker), len(plan.pending)))


@dataclass
class Helpers:
    """The started helper processes and the queue on which they report: each unit as a helper finishes it
    (relayed to `reporter`, by a thread of the command's process, as it arrives), then the units each
    helper finished, as it exits."""

    processes: list[Any]
    messages: Any  # multiprocessing Queue of ("unit", folder, status, detail) and ("finished", index, [folder])
    units: dict[str, run_plan.Unit]  # the plan's units by folder, to relay a helper's unit to `reporter`
    reporter: Reporter | None = None
    done: set[Path] = field(default_factory=set)
    _relay: threading.Thread | None = field(default=None, init=False, repr=False)

    def start_relay(self) -> None:
        """Relay the helpers' messages from a thread while the command's own process evaluates units."""
        self._relay = threading.Thread(target=self._read, name="ccq-eval-worker-relay", daemon=True)
        self._relay.start()

    def finish(self, *, wait: bool) -> set[Path]:
        """Wait for every helper (or, when the command's own run failed, stop them: what they answered
        stays in the units' resume caches) and return the unit folders they finished."""
        if not wait:
            for process in self.processes:
                process.terminate()
        if self._relay is not None:
            self._relay.join()
        else:
            self._read()
        for process in self.processes:
            process.join()
        return self.done

    def _read(self) -> None:
        """Read messages until every helper has sent its last one (or none is alive any more). They are
        read before the helpers are joined: a helper exits only once its messages have left the queue."""
        reports = 0
        while reports < len(self.processes):
            try:
                message = self.messages.get(timeout=1.0)
            except queue.Empty:
                if not any(process.is_alive() for process in self.processes):
                    break
                continue
            if message[0] == "unit":
                _, folder, status, detail = message
                if self.reporter is not None and folder in self.units:
                    self.reporter.unit_end(self.units[folder], status, detail)
            else:
                reports += 1
                self.done.update(Path(folder) for folder in message[2])


class _QueueReporter(SilentReporter):
    """A helper's reporter: each unit it finished goes to the command's process at once. A failure is not
    sent: the command's own process takes the unit up again and reports it with its full message."""

    def __init__(self, messages: Any) -> None:
        self.messages = messages

    def unit_end(self, unit: run_plan.Unit, status: str, detail: str = "") -> None:
        if status == "done":
            self.messages.put(("unit", str(unit.dir.path), status, detail))


class Terminated(SystemExit):
    """SIGTERM or SIGHUP received inside terminated_as_exit (its code: 128 + the signal's number)."""

    @property
    def signal_name(self) -> str:
        """"SIGTERM" or "SIGHUP": the signal that ended the run."""
        return signal.Signals(int(self.code) - 128).name


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM (what `timeout` and `kill` send) and SIGHUP (the terminal closed) raise
    Terminated (a SystemExit) in the main thread, so that the run ends as on Ctrl-C, with its line: its helper
    processes are stopped, what was answered stays in the units' resume caches. A SIGHUP that is ignored
    (`nohup`) stays ignored. Elsewhere than the main thread the signals are left as they are. A process forked
    inside the block (lm-eval's bootstrap pool) starts with the default action again (_default_signals_in_child):
    a Python-level handler there could lose a SIGTERM that lands just before the worker blocks on the pool's
    lock (the handler only flags it), and the pool's terminate() would then wait on that worker forever."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup the run outlives its terminal
        handled.append(signal.SIGHUP)
    previous = {signum: signal.signal(signum, _exit_on_term) for signum in handled}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _exit_on_term(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _default_signals_in_child() -> None:
    """In a process forked while terminated_as_exit is active: SIGTERM and SIGHUP take the kernel's default
    action (termination) again, with no window in which a signal is only flagged for Python to handle."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is _exit_on_term:
            signal.signal(signum, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_signals_in_child)


def _exit_with_parent(parent: int) -> None:
    """A helper's watch: when the command's process is gone (killed by a signal no handler sees), the
    helper ends too instead of computing units for nobody."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def start_helpers(execute: Callable[..., Any], plan: run_plan.RunPlan, count: int,
                  command_line: list[str], reporter: Reporter | None = None) -> Helpers:
    """Start `count` helper processes that run `execute` (runner.execute_plan, a module-level function:
    the child imports it by name, after it has switched off progress bars) on `plan`; spawned: a fresh
    interpreter, no forked torch state. `reporter` (the command's) hears of each unit a helper finishes."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    target = (execute.__module__, execute.__qualname__)
    processes = [context.Process(target=_helper_main, args=(target, plan, command_line, index, messages, os.getpid()),
                                 name=f"ccq-eval-worker-{index}") for index in range(count)]
    for process in processes:
        process.start()
    helpers = Helpers(processes, messages, {str(unit.dir.path): unit for unit in plan.units}, reporter)
    if reporter is not None:
        helpers.start_relay()
    return helpers


def _helper_main(target: tuple[str, str], plan: run_plan.RunPlan, command_line: list[str], index: int,
                 messages: Any, parent: int) -> None:
    """A helper: run the plan without progress bars or warnings, send each unit it finished as it finishes
    it, then the list of them. A unit that fails here is left to the command's own process, which takes it
    up again and reports the failure with its full message."""
    from ccq_eval import logs

    logs.hide_progress_bars()  # before `execute`'s module imports tqdm and the rest
    logs.ignore_unactionable_warnings()
    logging.disable(logging.WARNING)
    threading.Thread(target=_exit_with_parent, args=(parent,), name="ccq-eval-parent-watch", daemon=True).start()
    module_name, function_name = target
    execute = getattr(importlib.import_module(module_name), function_name)
    plan = replace(plan, options=replace(plan.options, keep_going=True))
    try:
        summary = execute(plan, command_line=command_line, reporter=_QueueReporter(messages))
        done = [str(unit.dir.path) for unit in summary.done]
    except BaseException:  # noqa: BLE001  (the command's process reports it, see above)
        done = []
    messages.put(("finished", index, done))
