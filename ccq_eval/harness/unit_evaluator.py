"""Evaluating one unit: the default evaluator loads the model, wraps it in the lm-eval adapter and the
resume cache (resume.ResumableLM) and runs lm-eval's evaluator on the unit's task (lm_eval_call.py).

The runner takes any `EvaluateUnit`; tests pass fakes, or this evaluator with a fake model loader.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness.fingerprints import changed_since_planning
from ccq_eval.harness.plan import PlanError, RunPlan, Unit
from ccq_eval.harness.resume import ResumableLM
from ccq_eval.harness.store import ResponseCache, ResultsStore
from ccq_eval.harness.task_registry import TaskCatalog
from ccq_eval.task_families import RECALL, ZEROSHOT, family_of


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
                          cuda_graphs: bool | None, rolling_windows: str | None = None,
                          hflm_lengths: bool = False) -> Any:
    """The adapter; batch_size / cuda_graphs None leave them to the adapter's "auto" (the fast path where
    it applies: a recurrent fla model on CUDA); rolling_windows None, its per-task protocol. hflm_lengths
    (the zero-shot suite's units): lm-eval HFLM's max length, `max_length` or else the one HFLM resolves from
    the model's config, cuts contexts from the left as HFLM does and is the width of HFLM's rolling windows."""
    from ccq_eval.harness.adapter import CCQEvalLM, hflm_max_length

    kwargs: dict[str, Any] = {"model": model, "tokenizer": tokenizer, "seed": seed,
                              "batch_size": "auto" if batch_size is None else batch_size,
                              "cuda_graphs": "auto" if cuda_graphs is None else cuda_graphs,
                              "rolling_windows": rolling_windows}
    if hflm_lengths:
        max_length = max_length or hflm_max_length(model, tokenizer)
        kwargs |= {"default_truncation": "left", "window_tokens": max_length}
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


def check_inputs_unchanged(unit: Unit, store: ResultsStore) -> None:
    """PlanError when a unit's checkpoint or data files are no longer the bytes planning hashed into its
    spec: what was loaded or read is then not what unit.json would record."""
    changed = changed_since_planning(unit)
    if changed:
        answered = store.answered(unit.dir)
        redo = (f"delete {unit.dir.path} (its {answered} answers may come from the old files) and rerun "
                "the same command" if answered else "rerun the same command")
        raise PlanError(f"{unit.model} / {unit.task}: files changed after the run was planned "
                        f"({changed}), so the unit was not stored; once they stay as they are, {redo}")


class LmEvalUnitEvaluator:
    """Default unit evaluator: model -> adapter -> ResumableLM -> lm-eval's evaluator.

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
        from ccq_eval.harness.lm_eval_call import evaluate_tasks

        plan, options = context.plan, context.plan.options
        model, tokenizer = self._model(unit.model_source, plan.device, plan.dtype, unit.spec.get("ccq_attach"))
        check_inputs_unchanged(unit, plan.store)  # after loading: the weights in memory are the ones unit.json records
        # The zero-shot suite's rolling tasks carry their protocol in the spec; other units leave it to the adapter.
        protocol = {"rolling_windows": unit.spec["rolling_windows"]} if "rolling_windows" in unit.spec else {}
        if family_of(unit.task) in (ZEROSHOT, RECALL):  # at lm-eval HFLM's lengths, as the papers' numbers are
            protocol["hflm_lengths"] = True
        adapter = self._make_adapter(model, tokenizer, unit.spec["max_length"], options.batch_size, options.seed,
                                     options.cuda_graphs, **protocol)
        # The most rows a batch may take (--batch-size, or the adapter's auto choice): also the requests per
        # resumable chunk, so that a chunk can fill a batch.
        batch_size = int(getattr(adapter, "batch_size", None) or options.batch_size or 1)
        wrapped = ResumableLM(adapter, context.cache, chunk_size=batch_size, on_progress=context.on_progress)
        catalog = self._task_catalog or run_plan.default_task_catalog()
        metadata = dict(unit.task_metadata)
        zeroshot_dir = metadata.pop("zeroshot_dir", None)  # lm-eval's own tasks get their data through it, not metadata
        # bootstrap_iters: lm-eval's 100000 unless --lm-eval-arg sets it. Only lm-eval's bootstrapped aggregations
        # spend it (the zero-shot suite's lambada perplexity); every aggregation of our tasks is a closed-form mean.
        results = evaluate_tasks(wrapped, catalog.make_task_manager(metadata), [unit.task], zeroshot_dir=zeroshot_dir,
                                 model_name=unit.model, limit=options.limit, batch_size=batch_size,
                                 device=plan.device, seed=options.seed, **plan.lm_eval_args)
        truncation = truncation_info(adapter)  # collective in a data-parallel run: every rank asks
        if results is None and wrapped.rank != 0:  # data-parallel: rank 0 gathers and stores the results
            return UnitOutcome(results={}, samples={})
        if results is None:
            raise RuntimeError(f"lm-eval returned no results for {unit.task}")
        samples = results.pop("samples", {}) or {}
        meta = {
            "model_config_sha256": model_config_sha256(model),
            # the family that ran (`compare --summary` groups by it): config.json's model_type as loaded
            "model_type": getattr(getattr(model, "config", None), "model_type", None),
            "truncation": truncation,
            "requests_from_cache": wrapped.cached_count,
            "requests_computed": wrapped.computed_count,
            **batch_sizes_meta(adapter, batch_size),
            "cuda_graphs": bool(getattr(adapter, "cuda_graphs", False)),  # as run
            "world_size": wrapped.world_size,  # processes sharing the unit (torchrun / accelerate launch)
        }
        return UnitOutcome(results=results, samples=samples, meta=meta)
