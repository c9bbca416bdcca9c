"""Executing a plan: one lm-eval evaluation per unit, each stored as soon as it finishes.

Execution skips finished units, resumes an interrupted one from its response cache (through
resume.ResumableLM) and stores each finished unit atomically, calling the plan's results store once per
phase of a unit: claim (its lock, then its folder read again under the lock), open, commit. The unit
evaluator is injectable (`EvaluateUnit`): the default one (unit_evaluator.LmEvalUnitEvaluator) loads the
model, wraps it in the lm-eval adapter and runs lm-eval's evaluator; tests pass fakes.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError
from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import workers as workers_module
from ccq_eval.harness.plan import RunPlan, Unit
from ccq_eval.harness.reporting import Reporter, SilentReporter
from ccq_eval.harness.run_options import options_command_line
from ccq_eval.harness.store import TIMESTAMP_FORMAT, ResultsError, ResultsStore
from ccq_eval.harness.unit_evaluator import (
    EvaluateUnit,
    LmEvalUnitEvaluator,
    UnitContext,
    UnitOutcome,
    check_inputs_unchanged,
    cpu_threads,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Executing a plan


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("ccq-eval", "torch", "transformers", "lm_eval", "flash-linear-attention", "numpy",
                    "datasets"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def gpu_kernel_settings() -> dict[str, str | None]:
    """Which kernel paths a CUDA run may use (bf16 results differ slightly between them): the CCQ read
    ("fused" where it applies: order-1 series reads at head dims 128 / 256; resolvent reads are always
    unfused), the scoring log-softmax. Recorded in CUDA runs' metadata (CPU runs use torch throughout), read
    in every run so that a bad setting fails before the first unit."""
    from ccq_eval.model.ccq import fused_kernel_enabled
    from ccq_eval.model.kernels.token_logprob import selected_implementation

    return {"ccq_read": "fused" if fused_kernel_enabled() else "unfused",
            "token_logprob": selected_implementation()}


def log_to_wandb(loggers: dict[str, dict[str, Any]], unit: Unit, outcome: UnitOutcome) -> None:
    """One stored unit through lm-eval's W&B logger, as its CLI does with --wandb_args (one W&B run
    per unit, named <model>/<task> unless wandb_args names it). A failure is logged, not raised: the
    unit is stored already."""
    from lm_eval.loggers import WandbLogger

    init_args = {"name": f"{unit.model}/{unit.task}"} | dict(loggers["wandb_args"])
    try:
        wandb_logger = WandbLogger(init_args, loggers.get("wandb_config_args"))
        wandb_logger.post_init(dict(outcome.results))
        wandb_logger.log_eval_result()
        wandb_logger.log_eval_samples(outcome.samples)
        wandb_logger.run.finish()
    except Exception as exc:  # noqa: BLE001  (as lm-eval's CLI: logging must not fail the run)
        logger.warning("logging %s / %s to W&B failed: %s", unit.model, unit.task, exc)


@dataclass
class RunSummary:
    done: list[Unit] = field(default_factory=list)
    skipped: list[Unit] = field(default_factory=list)
    failed: list[tuple[Unit, str]] = field(default_factory=list)
    elsewhere: list[Unit] = field(default_factory=list)  # finished by another worker on this folder


def process_rank() -> int:
    """This process's rank under torchrun / accelerate launch (both set RANK), else 0. Only rank 0
    writes to the results folder; the others take their share of each unit's requests."""
    return run_plan.environment_int("RANK", 0)


def default_evaluator() -> EvaluateUnit:
    """The unit evaluator `ccq-eval run` uses (a function, so tests can substitute one)."""
    return LmEvalUnitEvaluator()


def execute_plan(
    plan: RunPlan,
    *,
    evaluate_unit: EvaluateUnit | None = None,
    reporter: Reporter | None = None,
    command_line: Sequence[str] | None = None,
    workers: int | None = 1,
) -> RunSummary:
    """Evaluate every unfinished unit of `plan` and store it; finished units are skipped.

    A failing unit stops the run (or, with keep_going, is reported and the run goes on);
    what was finished or answered before stays on disk either way. workers > 1 starts that many - 1
    helper processes on the same plan (harness/workers.py), None as many as suit the device; helpers
    evaluate with the default evaluator.
    """
    session = RunSession(
        plan=plan,
        evaluate=evaluate_unit or default_evaluator(),
        report=reporter or SilentReporter(),
        argv=list(options_command_line(plan.options) if command_line is None else command_line),
        kernels=gpu_kernel_settings(),  # read (and a bad value refused) before any unit runs
        summary=RunSummary(skipped=[unit for unit in plan.units if unit.finished]),
    )
    for unit in session.summary.skipped:  # a stored non-finite result stays a failure on every rerun
        failure = plan.store.failure(unit.dir, unit.model)
        if failure is not None:
            session.summary.failed.append((unit, failure))
    session.report.run_start(plan)
    if workers is None:
        workers = workers_module.auto_workers(plan, cpu_threads())
    helpers = None
    if workers > 1:
        helpers = workers_module.start_helpers(execute_plan, plan, workers - 1, session.argv,
                                               reporter=session.report)
    completed = False
    try:
        with workers_module.terminated_as_exit():  # SIGTERM, SIGHUP end the helpers below too
            session.run(plan.pending)
        completed = True
    finally:
        session.report.run_end()
        if helpers is not None:
            session.count_helpers_units(helpers.finish(wait=completed))
    return session.summary


def _end_data_parallel() -> None:
    """In a data-parallel run, wait until rank 0 has stored every unit, then tear the process group
    down here rather than at interpreter exit, where gloo's threads can abort the process."""
    if run_plan.environment_int("WORLD_SIZE", 1) <= 1:
        return
    from ccq_eval.harness.adapter import end_process_group  # the group the adapter set up

    end_process_group()


@dataclass
class RunSession:
    """One execution of a plan: what evaluates its units (`evaluate`), what reports on them (`report`),
    the command line and GPU kernel settings recorded with each stored unit (`argv`, `kernels`), and
    what was done so far (`summary`). The plan's lm-eval loggers get each stored unit."""

    plan: RunPlan
    evaluate: EvaluateUnit
    report: Reporter
    argv: list[str]
    kernels: dict[str, str | None]
    summary: RunSummary

    @property
    def store(self) -> ResultsStore:
        return self.plan.store

    def run(self, pending: list[Unit]) -> None:
        """Evaluate and store the `pending` units: in a data-parallel launch all processes together, else
        one at a time under each unit's lock. Units another worker holds are left for later; by then that
        worker has usually finished them."""
        if run_plan.environment_int("WORLD_SIZE", 1) > 1:
            self.run_data_parallel(pending)
            return
        held_elsewhere: list[Unit] = []
        for index, unit in enumerate(pending):
            if not self.run_locked(unit, index, len(pending), blocking=False):
                held_elsewhere.append(unit)
        for unit in held_elsewhere:
            logger.info("waiting for another worker on %s / %s", unit.model, unit.task)
            self.run_locked(unit, pending.index(unit), len(pending), blocking=True)

    def count_helpers_units(self, folders: set[Path]) -> None:
        """Units this run's helper processes finished count as evaluated here, not by another worker."""
        ours = [unit for unit in self.summary.elsewhere if unit.dir.path in folders]
        self.summary.elsewhere = [unit for unit in self.summary.elsewhere if unit not in ours]
        self.summary.done.extend(ours)

    def run_data_parallel(self, pending: list[Unit]) -> None:
        """The processes of one data-parallel run (torchrun / accelerate launch) take every unit together,
        in plan order, each answering its share of the unit's requests (lm-eval splits them by rank): rank 0
        holds the unit's lock and stores it, the others write nothing. Such a run should be the only worker
        on its results folder: a unit another worker finished meanwhile would be skipped by rank 0 alone."""
        for index, unit in enumerate(pending):
            if process_rank() == 0:
                self.run_locked(unit, index, len(pending), blocking=True)
            else:
                self.evaluate_and_store(unit, writes=False)
        _end_data_parallel()

    def run_locked(self, unit: Unit, index: int, total: int, *, blocking: bool) -> bool:
        """Evaluate `unit` under its lock; False when another worker holds the lock (and not `blocking`).
        A unit that another worker finished meanwhile with the same settings is counted, not computed again;
        one it started or finished with other settings fails (check_against_disk)."""
        lock = self.store.claim(unit.dir, blocking=blocking)
        if lock is None:
            return False
        try:
            try:
                run_plan.check_against_disk(unit, self.store)  # another worker may have run it with other settings
            except run_plan.PlanError as exc:
                return self.fail(unit, exc)
            if unit.finished:
                failure = self.store.failure(unit.dir, unit.model)  # a helper's stored failure is this run's
                if failure is not None:
                    return self.fail(unit, ResultsError(failure))
                self.summary.elsewhere.append(unit)
                self.report.unit_end(unit, "done by another worker")
                return True
            self.report.unit_start(unit, index, total)
            self.evaluate_and_store(unit)
        finally:
            lock.release()
        return True

    def fail(self, unit: Unit, exc: Exception) -> bool:
        """Report `unit` as failed; raise `exc` unless the plan keeps going."""
        ours = isinstance(exc, UserError)  # our messages name the problem already
        detail = str(exc) if ours else f"{type(exc).__name__}: {exc}"
        self.report.unit_end(unit, "failed", detail)
        self.summary.failed.append((unit, detail))
        if not self.plan.options.keep_going:
            raise exc
        return True

    def evaluate_and_store(self, unit: Unit, *, writes: bool = True) -> None:
        """Evaluate and store `unit`; with writes=False (a data-parallel rank other than 0) only evaluate."""
        started = time.time()
        try:
            cache = self.store.open(unit.dir, unit.spec, write_spec_file=writes)
        except ResultsError as exc:
            self.fail(unit, exc)
            return
        try:
            report = self.report
            context = UnitContext(
                plan=self.plan,
                cache=cache,
                on_progress=lambda done, total, cell, unit=unit: report.requests(unit, done, total, cell),
            )
            outcome = self.evaluate(unit, context)
        except Exception as exc:  # noqa: BLE001  (any failure of a unit is reported, then raised or not)
            self.fail(unit, exc)
            return
        finally:
            cache.close()
        wall_time = time.time() - started
        try:
            check_inputs_unchanged(unit, self.store)  # the data files were read during the evaluation
        except run_plan.PlanError as exc:
            self.fail(unit, exc)
            return
        if not writes:
            self.summary.done.append(unit)
            return
        self.commit(unit, outcome, started, wall_time)

    def unit_meta(self, unit: Unit, outcome: UnitOutcome, started: float, wall_time: float) -> dict[str, Any]:
        """meta.json of a finished unit: what was asked, what ran (the evaluator's meta wins), where, when."""
        plan = self.plan
        return {
            "model": unit.model,
            "model_source": unit.model_source,
            "task": unit.task,
            "requested_as": unit.requested_as,
            "spec": unit.spec,
            "seed": plan.options.seed,
            "device": plan.device,  # as run; *_requested: as asked (plan.resolve_device / resolve_dtype)
            "device_requested": plan.options.device,
            "dtype": plan.dtype,
            "dtype_requested": plan.options.dtype,
            "batch_size": plan.options.batch_size,  # the evaluator's meta says what ran
            "batch_size_requested": plan.options.batch_size or "auto",
            "wall_time_s": round(wall_time, 3),
            "started_at": time.strftime(TIMESTAMP_FORMAT, time.localtime(started)),
            "finished_at": time.strftime(TIMESTAMP_FORMAT),
            "command_line": shlex.join(self.argv),
            "argv": list(sys.argv),
            "cwd": os.getcwd(),
            "pid": os.getpid(),  # which worker process computed it (`run --workers`)
            "run_units": [[other.model, other.task] for other in plan.units],  # what the command asked for
            "versions": package_versions(),
            "gpu_kernels": self.kernels if plan.device.startswith("cuda") else None,
            "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
            "cuda_graphs": plan.options.cuda_graphs,  # the evaluator's meta says what ran
            "cuda_graphs_requested": "auto" if plan.options.cuda_graphs is None else plan.options.cuda_graphs,
            "platform": platform.platform(),
        } | outcome.meta

    def commit(self, unit: Unit, outcome: UnitOutcome, started: float, wall_time: float) -> None:
        """Store the evaluated `unit` (the store drops its resume cache), log it to the plan's lm-eval loggers;
        a non-finite result is stored and then reported as a failure."""
        failure = self.store.commit(unit.dir, unit.model, outcome.results, outcome.samples,
                                    self.unit_meta(unit, outcome, started, wall_time))
        if self.plan.lm_eval_loggers:
            log_to_wandb(self.plan.lm_eval_loggers, unit, outcome)
        unit.finished = True
        if failure is not None:
            self.fail(unit, ResultsError(failure))
            return
        self.summary.done.append(unit)
        self.report.unit_end(unit, "done", f"{wall_time:.1f} s")
