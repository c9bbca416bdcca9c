"""Executing a plan: one lm-eval evaluation per unit, each stored as soon as it finishes.

Execution skips finished units, resumes an interrupted one from its response cache
(results_store.ResponseCache, through resume.ResumableLM) and stores each finished unit atomically.
The unit evaluator is injectable (`EvaluateUnit`): the default one loads the model, wraps it in the
lm-eval adapter and calls lm_eval.simple_evaluate; tests pass fakes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import sys
import time
import unittest.mock
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import results_store
from ccq_eval.harness import workers as workers_module
from ccq_eval.harness.plan import RunPlan, TaskCatalog, Unit, options_command_line
from ccq_eval.harness.reporting import Reporter, SilentReporter
from ccq_eval.harness.results_store import ResponseCache, ResultsError
from ccq_eval.harness.resume import ResumableLM

logger = logging.getLogger(__name__)


@dataclass
class UnitOutcome:
    results: dict[str, Any]  # lm-eval results dict
    samples: dict[str, list[dict[str, Any]]]  # lm-eval logged samples per task
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class UnitContext:
    plan: RunPlan
    cache: ResponseCache
    on_progress: Callable[[int, int, str], None]


EvaluateUnit = Callable[[Unit, UnitContext], UnitOutcome]


def cpu_threads() -> int:
    """torch's intra-op threads for a CPU evaluation: OMP_NUM_THREADS when the user set it, else half
    the usable cores (at least one). All cores oversubscribe the machine as soon as anything else runs
    beside the evaluation (lm-eval's own Python work, another run, a test job), which slows the small
    models evaluated on CPUs severalfold (benchmarks/README.md, "CPU threads")."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, usable // 2)


def _load_model_default(source: str, device: str, dtype: str | None,
                        ccq_attach: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The model of a unit; ccq_attach (a --ccq-attach unit's spec entry) attaches CCQ at its lambda."""
    from ccq_eval.model.loading import load_model

    if device == "cpu":
        import torch

        torch.set_num_threads(cpu_threads())
    if ccq_attach is None:
        return load_model(source, device=device, dtype=dtype)
    return load_model(source, device=device, dtype=dtype, ccq_lambda=ccq_attach["lambda"],
                      ccq_fields=ccq_attach["fields"])


def _make_adapter_default(model: Any, tokenizer: Any, max_length: int | None, batch_size: int | None, seed: int,
                          cuda_graphs: bool | None) -> Any:
    """The adapter; batch_size / cuda_graphs None leave them to the adapter's "auto" (the fast path where
    it applies: a recurrent fla model on CUDA)."""
    from ccq_eval.harness.adapter import CCQEvalLM

    kwargs: dict[str, Any] = {"model": model, "tokenizer": tokenizer, "seed": seed,
                              "batch_size": "auto" if batch_size is None else batch_size,
                              "cuda_graphs": "auto" if cuda_graphs is None else cuda_graphs}
    if max_length is not None:
        kwargs["max_length"] = max_length
    return CCQEvalLM(**kwargs)


def batch_sizes_meta(adapter: Any, batch_size: int) -> dict[str, Any]:
    """meta.json's batch sizes as run: "batch_size" is `batch_size` (the most rows a batch may take), or with
    the adapter's auto sizing the largest batch that ran; "batch_sizes_run" maps the rows of a batch to the
    batches that ran with that many (None for an adapter that does not count them)."""
    used = getattr(adapter, "batch_sizes_run", None)
    largest = max(used) if getattr(adapter, "batch_size_auto", False) and used else batch_size
    runs = None if used is None else {str(rows): used[rows] for rows in sorted(used, reverse=True)}
    return {"batch_size": largest, "batch_sizes_run": runs}


def model_config_sha256(model: Any) -> str | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    payload = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def truncation_info(adapter: Any) -> dict[str, Any] | None:
    """The adapter's truncation bookkeeping: policy per task and how many prompts were cut."""
    summary = getattr(adapter, "truncation_summary", None)
    if callable(summary):
        return summary()
    return None


def check_inputs_unchanged(unit: Unit) -> None:
    """PlanError when a unit's checkpoint or data files are no longer the bytes planning hashed into its
    spec: what was loaded or read is then not what unit.json would record."""
    changed = run_plan.changed_since_planning(unit)
    if changed:
        answered = results_store.answered_count(unit.dir.responses_db)
        redo = (f"delete {unit.dir.path} (its {answered} answers may come from the old files) and rerun "
                "the same command" if answered else "rerun the same command")
        raise run_plan.PlanError(f"{unit.model} / {unit.task}: files changed after the run was planned "
                                 f"({changed}), so the unit was not stored; once they stay as they are, {redo}")


def quiet_git_commit_hash() -> str | None:
    """lm-eval's get_git_commit_hash (the results' git_hash) without git's "fatal: not a git repository"
    on stderr, which lm-eval's version prints once per unit outside a git checkout."""
    import subprocess

    try:
        return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        from lm_eval.loggers.utils import get_commit_from_path

        return get_commit_from_path(os.getcwd())


class LmEvalUnitEvaluator:
    """Default unit evaluator: model -> adapter -> ResumableLM -> lm_eval.simple_evaluate.

    Keeps the last loaded model, so consecutive units of one model load it once.
    """

    def __init__(
        self,
        *,
        load_model: Callable[..., tuple[Any, Any]] = _load_model_default,  # (source, device, dtype[, ccq_attach])
        make_adapter: Callable[[Any, Any, int | None, int | None, int, bool | None], Any] = _make_adapter_default,
        task_catalog: TaskCatalog | None = None,
    ) -> None:
        self._load_model = load_model
        self._make_adapter = make_adapter
        self._task_catalog = task_catalog
        self._loaded_key: tuple[str, str, str | None, str] | None = None
        self._loaded: tuple[Any, Any] | None = None

    def _model(self, source: str, device: str, dtype: str | None,
               ccq_attach: dict[str, Any] | None = None) -> tuple[Any, Any]:
        key = (source, device, dtype, json.dumps(ccq_attach, sort_keys=True))  # each --ccq-attach lambda its own
        if self._loaded_key != key:
            self._loaded = None  # free the previous model before loading the next
            self._loaded = (self._load_model(source, device, dtype) if ccq_attach is None
                            else self._load_model(source, device, dtype, ccq_attach))
            self._loaded_key = key
        assert self._loaded is not None
        return self._loaded

    def __call__(self, unit: Unit, context: UnitContext) -> UnitOutcome:
        from lm_eval import evaluator

        options = context.plan.options
        model, tokenizer = self._model(unit.model_source, context.plan.device, context.plan.dtype,
                                       unit.spec.get("ccq_attach"))
        check_inputs_unchanged(unit)  # after loading: the weights in memory are the ones unit.json records
        adapter = self._make_adapter(model, tokenizer, unit.spec["max_length"], options.batch_size, options.seed,
                                     options.cuda_graphs)
        # The most rows a batch may take (--batch-size, or the adapter's auto choice): also the requests per
        # resumable chunk, so that a chunk can fill a batch.
        batch_size = int(getattr(adapter, "batch_size", None) or options.batch_size or 1)
        wrapped = ResumableLM(adapter, context.cache, chunk_size=batch_size, on_progress=context.on_progress)
        catalog = self._task_catalog or run_plan.default_task_catalog()
        metadata = dict(unit.spec["task_metadata"])
        metadata.setdefault("tokenizer", unit.model_source)
        task_manager = catalog.make_task_manager(metadata)
        seed = options.seed
        kwargs = {"bootstrap_iters": 1000} | dict(context.plan.lm_eval_args)
        # simple_evaluate's git lookup without git's stderr noise, for this call only (lm-eval stays as it is).
        with unittest.mock.patch.object(evaluator, "get_git_commit_hash", quiet_git_commit_hash):
            results = evaluator.simple_evaluate(
                model=wrapped,
                tasks=[unit.task],
                task_manager=task_manager,
                limit=options.limit,
                log_samples=True,
                batch_size=batch_size,
                device=context.plan.device,
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
                **kwargs,
            )
        truncation = truncation_info(adapter)  # collective in a data-parallel run: every rank asks
        if results is None and wrapped.rank != 0:  # data-parallel: rank 0 gathers and stores the results
            return UnitOutcome(results={}, samples={})
        if results is None:
            raise RuntimeError(f"lm-eval returned no results for {unit.task}")
        samples = results.pop("samples", {}) or {}
        if isinstance(results.get("config"), dict):
            results["config"]["model"] = unit.model
        meta = {
            "model_config_sha256": model_config_sha256(model),
            "truncation": truncation,
            "requests_from_cache": wrapped.cached_count,
            "requests_computed": wrapped.computed_count,
            **batch_sizes_meta(adapter, batch_size),
            "cuda_graphs": bool(getattr(adapter, "cuda_graphs", False)),  # as run
            "world_size": wrapped.world_size,  # processes sharing the unit (torchrun / accelerate launch)
        }
        return UnitOutcome(results=results, samples=samples, meta=meta)


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
    unfused), the scoring log-softmax, the autotuning cap. Recorded in CUDA runs' metadata (CPU runs use torch
    throughout), read in every run so that a bad setting fails before the first unit."""
    from ccq_eval.model.ccq import fused_kernel_enabled
    from ccq_eval.model.kernels import autotune
    from ccq_eval.model.kernels.token_logprob import selected_implementation

    limit = autotune.configured_limit()  # candidates per fla kernel
    return {"ccq_read": "fused" if fused_kernel_enabled() else "unfused",
            "token_logprob": selected_implementation(),
            "autotune_configs": "all" if limit is None else str(limit)}


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
        non_finite = results_store.non_finite_values(results_store.read_json(unit.dir.results))
        if non_finite:
            session.summary.failed.append((unit, results_store.non_finite_message(unit.model, non_finite)))
    session.report.run_start(plan)
    if workers is None:
        workers = workers_module.auto_workers(plan, cpu_threads())
    helpers = None
    if workers > 1:
        helpers = workers_module.start_helpers(execute_plan, plan, workers - 1, session.argv)
    completed = False
    try:
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
        lock = results_store.UnitLock(unit.dir)
        if not lock.acquire(blocking=blocking):
            return False
        try:
            try:
                run_plan.check_against_disk(unit)  # another worker may have run it with other settings
            except run_plan.PlanError as exc:
                return self.fail(unit, exc)
            if unit.finished:
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
        ours = isinstance(exc, (run_plan.PlanError, ResultsError))  # our messages name the problem already
        detail = str(exc) if ours else f"{type(exc).__name__}: {exc}"
        self.report.unit_end(unit, "failed", detail)
        self.summary.failed.append((unit, detail))
        if not self.plan.options.keep_going:
            raise exc
        return True

    def evaluate_and_store(self, unit: Unit, *, writes: bool = True) -> None:
        """Evaluate and store `unit`; with writes=False (a data-parallel rank other than 0) only evaluate."""
        if writes:
            results_store.atomic_write_json(unit.dir.spec, unit.spec)
        started = time.time()
        try:
            cache = ResponseCache(unit.dir.responses_db, identity=results_store.spec_identity(unit.spec))
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
            check_inputs_unchanged(unit)  # the data files were read during the evaluation
        except run_plan.PlanError as exc:
            self.fail(unit, exc)
            return
        if not writes:
            self.summary.done.append(unit)
            return
        self.store(unit, outcome, started, wall_time)

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
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command_line": shlex.join(self.argv),
            "argv": list(sys.argv),
            "cwd": os.getcwd(),
            "pid": os.getpid(),  # which worker process computed it (`run --workers`)
            "versions": package_versions(),
            "gpu_kernels": self.kernels if plan.device.startswith("cuda") else None,
            "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
            "cuda_graphs": plan.options.cuda_graphs,  # the evaluator's meta says what ran
            "cuda_graphs_requested": "auto" if plan.options.cuda_graphs is None else plan.options.cuda_graphs,
            "platform": platform.platform(),
        } | outcome.meta

    def store(self, unit: Unit, outcome: UnitOutcome, started: float, wall_time: float) -> None:
        """Write the evaluated `unit`, drop its resume cache, log it to the plan's lm-eval loggers; a
        non-finite result is stored and then reported as a failure."""
        results_store.write_unit(unit.dir, outcome.results, outcome.samples,
                                 self.unit_meta(unit, outcome, started, wall_time))
        results_store.remove_resume_cache(unit.dir)  # the unit is stored: its answers are in its samples
        if self.plan.lm_eval_loggers:
            log_to_wandb(self.plan.lm_eval_loggers, unit, outcome)
        unit.finished = True
        non_finite = results_store.non_finite_values(outcome.results)
        if non_finite:
            self.fail(unit, ResultsError(results_store.non_finite_message(unit.model, non_finite)))
            return
        self.summary.done.append(unit)
        self.report.unit_end(unit, "done", f"{wall_time:.1f} s")
