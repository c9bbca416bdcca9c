"""Helper processes that share one plan with the command's own process (`ccq-eval run --workers N`).

A CPU evaluation of the small models runs one torch thread per process (runner.cpu_threads: more threads
per process slow it down), so one process leaves the other cores idle. Helpers run the same plan; every
unit is taken under its lock (results_store.UnitLock), so each is computed once, by whichever process gets
to it first, and stored exactly as the command's own process would store it. Each helper sends back the
units it finished, so the command's summary counts them as evaluated here.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ccq_eval.harness import plan as run_plan

# Tests set this to 1 so that "auto" keeps fakes and counts in one process.
WORKERS_ENV = "CCQ_EVAL_WORKERS"


def auto_workers(plan: run_plan.RunPlan, threads_per_worker: int) -> int:
    """Processes for "auto": on a CPU, as many as the usable cores hold at `threads_per_worker` threads
    each, at most one per pending unit; one on a GPU and under a data-parallel launch (one device, and
    torchrun's ranks already split each unit). CCQ_EVAL_WORKERS overrides it."""
    if os.environ.get(WORKERS_ENV, "").isdigit() and int(os.environ[WORKERS_ENV]) > 0:
        return int(os.environ[WORKERS_ENV])
    if plan.device != "cpu" or run_plan.environment_int("WORLD_SIZE", 1) > 1:
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable // max(1, threads_per_worker), len(plan.pending)))


@dataclass
class Helpers:
    """The started helper processes and the queue on which each reports the units it finished."""

    processes: list[Any]
    finished: Any  # multiprocessing Queue of (helper index, [unit folder, ...])

    def finish(self, *, wait: bool) -> set[Path]:
        """Wait for every helper (or, when the command's own run failed, stop them: what they answered
        stays in the units' resume caches) and return the unit folders they finished."""
        done: set[Path] = set()
        if not wait:
            for process in self.processes:
                process.terminate()
        reports = 0
        # Reports are read before joining: a helper exits only once its report has left the queue.
        while reports < len(self.processes):
            try:
                _, folders = self.finished.get(timeout=1.0)
            except queue.Empty:
                if not any(process.is_alive() for process in self.processes):
                    break
                continue
            reports += 1
            done.update(Path(folder) for folder in folders)
        for process in self.processes:
            process.join()
        return done


def start_helpers(execute: Callable[..., Any], plan: run_plan.RunPlan, count: int,
                  command_line: list[str]) -> Helpers:
    """Start `count` helper processes that run `execute` (runner.execute_plan, a module-level function:
    the child imports it by name) on `plan`; spawned: a fresh interpreter, no forked torch state."""
    context = multiprocessing.get_context("spawn")
    finished = context.Queue()
    processes = [context.Process(target=_helper_main, args=(execute, plan, command_line, index, finished),
                                 name=f"ccq-eval-worker-{index}") for index in range(count)]
    for process in processes:
        process.start()
    return Helpers(processes, finished)


def _helper_main(execute: Callable[..., Any], plan: run_plan.RunPlan, command_line: list[str], index: int,
                 finished: Any) -> None:
    """A helper: run the plan silently and report the units it finished. A unit that fails here is left to
    the command's own process, which takes it up again and reports the failure with its full message."""
    from ccq_eval import logs

    logs.silence_progress_bars()
    logging.disable(logging.WARNING)
    plan = replace(plan, options=replace(plan.options, keep_going=True))
    try:
        summary = execute(plan, command_line=command_line)
        done = [str(unit.dir.path) for unit in summary.done]
    except BaseException:  # noqa: BLE001  (the command's process reports it, see above)
        done = []
    finished.put((index, done))
