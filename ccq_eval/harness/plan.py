"""Planning a run: options -> validated units (model x lm-eval task), before any model is loaded.

A unit is one (model, lm-eval task) pair. Planning parses every option once (options.parse_options),
resolves model and task names (model_resolution, task_selection) and checks each unit against what its
folder already holds, so a bad command fails in a second; it imports neither torch nor lm-eval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.atomic_io import dumps
from ccq_eval.harness.fingerprints import checkpoint_fingerprint, data_fingerprint, embedded_corpora_fingerprint
from ccq_eval.harness.model_resolution import ResolvedModels, resolve_models, tokenizer_metadata
from ccq_eval.harness.options import (
    Grid,
    ParsedOptions,
    PlanError,
    check_device_form,
    environment_int,
    parse_options,
)
from ccq_eval.harness.run_options import RunOptions
from ccq_eval.harness.store import ResultsError, ResultsStore, UnitDir
from ccq_eval.harness.suites import suite_lengths
from ccq_eval.harness.task_identity import package_versions, reads_embedded_corpora, task_definition
from ccq_eval.harness.task_registry import RegistryTaskCatalog, TaskCatalog
from ccq_eval.harness.task_selection import RunTasks, select_tasks
from ccq_eval.harness.zeroshot import HFLM_ROLLING_TASKS, rolling_protocol
from ccq_eval.model import registry as model_registry_module
from ccq_eval.model.registry import ModelEntry, RegistryError
from ccq_eval.task_families import FAMILY_METADATA_KEYS, RECALL, RECALL_LMEVAL_TASKS, ZEROSHOT, family_of

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
# Task metadata that names a folder on this machine: a unit's identity records the content of the file the
# task reads there (its spec's data_files), not the folder, so that a copy of the data elsewhere is the same.
FOLDER_METADATA_KEYS = ("qa_dir", "data_dir", "zeroshot_dir", "recall_dir")
# The jrt recall tasks' cut and prompt (lm-eval's own recall tasks have neither).
RECALL_JRT_KEYS = ("recall_length", "recall_prompt")
# How the zero-shot suite's loglikelihood units fit a context over the max length (their spec's
# context_truncation): cut from the left as lm-eval's HFLM cuts it (scoring.Scorer._prepare_loglikelihood).
# A stored unit without this field scored such contexts whole: it differs in it and is not reused.
ZEROSHOT_CONTEXT_TRUNCATION = "left"

# --------------------------------------------------------------------------------------------
# Defaults that fit the machine


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch; a function, so tests can fake a GPU)."""
    import torch

    return torch.cuda.is_available()


def resolve_device(requested: str) -> str:
    """--device auto -> "cuda" when CUDA is present, else "cpu"; other values as given, except that
    under torchrun / accelerate launch with several processes "cuda" is this process's GPU
    (cuda:LOCAL_RANK), so the processes do not all load their model onto the first GPU. A device that
    is not one of auto, cpu, mps, cuda, cuda:N, or CUDA on a machine without it, is a PlanError."""
    check_device_form(requested)
    device = requested
    if requested == "auto":
        device = "cuda" if cuda_available() else "cpu"
    elif device.startswith("cuda") and not cuda_available():
        raise PlanError(f"--device {requested}: torch sees no CUDA device on this machine; use --device cpu "
                        "(or auto, which takes CUDA where there is one)")
    if device == "cuda" and environment_int("WORLD_SIZE", 1) > 1:
        return f"cuda:{environment_int('LOCAL_RANK', 0)}"
    return device


def resolve_dtype(requested: str | None, device: str) -> str:
    """--dtype auto (or none) -> bfloat16 on CUDA, float32 elsewhere; aliases (bf16, fp32, ...) -> the
    torch name, so a unit's spec names one dtype one way."""
    if requested in (None, "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    return _DTYPE_NAMES.get(requested, requested)


def default_task_catalog() -> TaskCatalog:
    """The task catalog commands use (a function, so tests can substitute one)."""
    return RegistryTaskCatalog()


def load_model_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    """The model registry (ccq_eval.model.registry), its errors as PlanError."""
    try:
        return model_registry_module.load_model_registry(path)
    except RegistryError as exc:
        raise PlanError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class Unit:
    """One (model, lm-eval task) evaluation and where it is stored."""

    model: str
    model_source: str
    task: str
    requested_as: str
    dir: UnitDir
    spec: dict[str, Any]  # what the unit computes (its unit.json); no path of this machine in it
    task_metadata: dict[str, Any] = field(default_factory=dict)  # what the task is given (folders, tokenizer)
    finished: bool = False
    in_shard: bool = True  # False: another worker's part of the units (--shard)
    identity_assumed: bool = False  # finished by a version that recorded no task definition: taken as this one
    corpora_assumed: bool = False  # finished before the embedded corpora it reads were recorded: taken as stored
    corpora_changed: list[str] = field(default_factory=list)  # embedded corpora edited since it finished: redone


@dataclass
class RunPlan:
    options: RunOptions
    store: ResultsStore  # the results folder the units are stored in (options.output)
    units: list[Unit]
    lengths: list[int] | None
    depths: list[float] | None
    lm_eval_args: dict[str, Any]
    task_metadata: dict[str, Any]
    lm_eval_loggers: dict[str, dict[str, Any]] = field(default_factory=dict)  # options.split_logger_args
    device: str = "cpu"  # options.device resolved (resolve_device)
    dtype: str = "float32"  # options.dtype resolved (resolve_dtype)
    notes: list[str] = field(default_factory=list)  # what was left out, and why (shown to the user)

    @property
    def pending(self) -> list[Unit]:
        return [unit for unit in self.units if not unit.finished and unit.in_shard]


def metadata_for_task(task: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The part of the run's task metadata that can change `task`'s documents (its family's
    metadata_keys, and the keys no family is selective about).

    Keeping the rest out of the unit's spec lets a later run add, say, S-NIAH depths without
    the perplexity units counting as asked a different question."""
    keys = family_of(task).metadata_keys - (set(RECALL_JRT_KEYS) if task in RECALL_LMEVAL_TASKS else set())
    return {key: value for key, value in metadata.items() if key not in FAMILY_METADATA_KEYS or key in keys}


def plan_run(
    options: RunOptions,
    *,
    model_registry: dict[str, ModelEntry] | None = None,
    task_catalog: TaskCatalog | None = None,
) -> RunPlan:
    """Validate options and resolve names into units. Loads nothing; raises PlanError."""
    parsed = parse_options(options)
    registry = load_model_registry() if model_registry is None else model_registry
    models = resolve_models(options, registry, parsed.attach, parsed.grid.using_defaults)
    catalog = default_task_catalog() if task_catalog is None else task_catalog
    tasks = select_tasks(parsed, catalog, with_sweep=bool(models.sweep_only))
    task_metadata = _task_metadata(parsed)

    device = resolve_device(options.device)  # after every check above: this one may import torch
    if options.cuda_graphs and not device.startswith("cuda"):
        raise PlanError(f"--cuda-graphs needs a CUDA device; --device {options.device} gave {device} "
                        "(no CUDA device is visible); drop --cuda-graphs or run on a GPU")
    dtype = resolve_dtype(options.dtype, device)
    _check_models_run_on(models, device, dtype)

    store = ResultsStore(Path(options.output))
    units = _build_units(parsed, store, models, tasks, task_metadata, dtype)
    if parsed.shard is not None:
        index, count = parsed.shard
        for position, unit in enumerate(units):
            unit.in_shard = position % count == index - 1
    return RunPlan(options=options, store=store, units=units, lengths=parsed.grid.lengths,
                   depths=parsed.grid.depths, lm_eval_args=parsed.lm_eval_args, lm_eval_loggers=parsed.lm_eval_loggers,
                   task_metadata=task_metadata, device=device, dtype=dtype,
                   notes=tasks.notes + _older_units_note(units) + _corpora_notes(units))


def _check_models_run_on(models: ResolvedModels, device: str, dtype: str) -> None:
    """Before anything loads: a checkpoint folder whose family cannot run on `device` (no CPU version of its
    ops), or in `dtype` there, stops the run in one line naming the model, its family, the reason and the
    alternative. (ccq_eval.model.loading imports fla, seconds: only where a checkpoint folder is checked.)"""
    for model in models.models:
        if Path(model.source).is_dir():
            from ccq_eval.model.loading import ModelLoadError, check_runs_on

            try:
                check_runs_on(Path(model.source), device, dtype)
            except ModelLoadError as exc:
                raise PlanError(f"--model {model.name}: {exc}") from None


def _older_units_note(units: list[Unit]) -> list[str]:
    """One note for the finished units an older ccq-eval stored without their task definition and versions."""
    older = [unit for unit in units if unit.identity_assumed]
    if not older:
        return []
    which = f"{len(older)} finished units (first {older[0].dir.path})" if len(older) > 1 else \
        f"1 finished unit ({older[0].dir.path})"
    return [f"{which} "
            "stored by an older ccq-eval that did not record the task definition and versions: taken as "
            "stored (delete a unit's folder to redo it with this version)"]


def _corpora_notes(units: list[Unit]) -> list[str]:
    """One note for the finished units redone because an embedded corpus they read changed, one for those
    stored before the corpora were recorded."""
    notes = []
    changed = [unit for unit in units if unit.corpora_changed]
    if changed:
        files = sorted({name for unit in changed for name in unit.corpora_changed})
        notes.append(f"{_units(changed)} read embedded corpora that changed since they were stored "
                     f"({', '.join(files)}): computed again; their stored results stay until the new ones replace them")
    older = [unit for unit in units if unit.corpora_assumed]
    if older:
        notes.append(f"{_units(older)} stored before the embedded corpora a unit reads were recorded: taken as "
                     "stored (delete a unit's folder to redo it with this installation's corpora)")
    return notes


def _units(units: list[Unit]) -> str:
    """'1 finished unit (<folder>)' or 'N finished units (first <folder>)'."""
    if len(units) == 1:
        return f"1 finished unit ({units[0].dir.path})"
    return f"{len(units)} finished units (first {units[0].dir.path})"


def _task_metadata(parsed: ParsedOptions) -> dict[str, Any]:
    """The metadata every task of the run is given (each unit's spec records its family's part of it)."""
    grid: Grid = parsed.grid
    task_metadata: dict[str, Any] = {"seed": parsed.options.seed}
    if grid.lengths is not None:
        task_metadata["lengths"] = grid.lengths
    if grid.depths is not None:
        task_metadata["depths"] = grid.depths
    if grid.samples_per_cell is not None:
        task_metadata["samples_per_cell"] = grid.samples_per_cell
    if parsed.longbench_dir is not None:
        task_metadata["data_dir"] = str(parsed.longbench_dir.resolve())  # tasks/longbench's key
    if parsed.qa_dir is not None:
        task_metadata["qa_dir"] = str(parsed.qa_dir)  # tasks/ruler_qa's key
    if parsed.zeroshot_dir is not None:
        task_metadata["zeroshot_dir"] = str(parsed.zeroshot_dir)  # read by the evaluator (zeroshot.load_tasks)
    # The recall tasks' cut and prompt (tasks/recall's keys), recorded in the spec of their units only.
    task_metadata["recall_length"] = parsed.options.recall_length or 2048
    task_metadata["recall_prompt"] = parsed.options.recall_prompt or "once"
    if parsed.recall_dir is not None:
        task_metadata["recall_dir"] = str(parsed.recall_dir)  # tasks/recall's key; lm_eval_call's for lm-eval's own
    return task_metadata


def _build_units(parsed: ParsedOptions, store: ResultsStore, models: ResolvedModels, tasks: RunTasks,
                 task_metadata: dict[str, Any], dtype: str) -> list[Unit]:
    """One unit per (model, task), its spec in the form it has once stored, checked against its folder."""
    options, units, versions = parsed.options, [], package_versions()
    corpora: dict[str, str] | None = None  # embedded_corpora_fingerprint(), hashed once per plan when a task reads them
    for model in models.models:
        fingerprint = checkpoint_fingerprint(model.source)
        tokenizer = tokenizer_metadata(model, fingerprint)
        for task, requested_as in (tasks.sweep_tasks if model.name in models.sweep_only else tasks.resolved):
            unit_metadata, unit_max_length = task_metadata, parsed.grid.max_length
            if family_of(task) in (ZEROSHOT, RECALL):  # HFLM's max length: --max-length, else the config's
                unit_max_length = options.max_length
            elif task in tasks.part_of and tasks.part_of[task].lengths:
                unit_lengths = suite_lengths(tasks.part_of[task], model)
                if options.max_length and options.max_length < max(unit_lengths):
                    raise PlanError(f"--max-length {options.max_length} is shorter than {task}'s longest length "
                                    f"in --suite {options.suite} ({max(unit_lengths)}); raise or drop --max-length")
                unit_metadata = dict(task_metadata, lengths=unit_lengths)
                unit_max_length = options.max_length or max(unit_lengths)
            given = metadata_for_task(task, unit_metadata)
            spec = {  # what the unit computes; a folder's location is not part of it (meta.json has it)
                "model": model.name,
                "checkpoint": fingerprint,
                "task": task,
                "task_metadata": {key: value for key, value in given.items() if key not in FOLDER_METADATA_KEYS},
                "limit": options.limit,
                "dtype": dtype,
                "max_length": unit_max_length,
                "lm_eval_args": parsed.lm_eval_args,
                "task_definition": task_definition(task),  # its YAML, hooks and data files as loaded
                "versions": versions,
            }
            if task in HFLM_ROLLING_TASKS:  # the protocol that scores its texts decides its perplexity
                spec["rolling_windows"] = rolling_protocol(task, options.rolling_windows)
            elif family_of(task) is ZEROSHOT:  # contexts over the max length cut as lm-eval's HFLM cuts them
                spec["context_truncation"] = ZEROSHOT_CONTEXT_TRUNCATION
            if model.name in models.attachments:
                spec["ccq_attach"] = models.attachments[model.name]
            data_files = data_fingerprint(task, given)
            if data_files is not None:
                spec["data_files"] = data_files
            if reads_embedded_corpora(task):  # an edited corpus (an editable install) makes its units be redone
                corpora = embedded_corpora_fingerprint() if corpora is None else corpora
                spec["embedded_corpora"] = corpora
            unit = Unit(model=model.name, model_source=model.source, task=task, requested_as=requested_as,
                        dir=store.unit(model.name, task), spec=json.loads(dumps(spec)),  # the form it has once stored
                        task_metadata=json.loads(dumps(given)) | tokenizer)
            check_against_disk(unit, store)
            units.append(unit)
    return units


def check_against_disk(unit: Unit, store: ResultsStore) -> None:
    """A unit folder from an earlier run must have been asked the same question (a folder whose run
    failed before answering anything is free to take), and its files must be readable.

    A finished unit's question is its unit.json (for a version-1 unit without one, the copy in meta.json);
    a finished unit with neither cannot show what produced its numbers and is refused rather than taken
    for this one. A unit folder that is a symbolic link, or lies in one below the results folder, is refused:
    the readers do not follow links, and a recompute would write into the folder it points at."""
    _check_not_linked(unit)
    try:
        on_disk = store.on_disk(unit.dir)
    except ResultsError as exc:
        raise PlanError(str(exc)) from None
    stored = on_disk.spec
    if on_disk.finished or on_disk.answered:
        stored = _with_identity_of_old_units(unit, stored)
    if on_disk.finished and isinstance(stored, dict) and CORPORA_KEY in unit.spec and CORPORA_KEY not in stored:
        unit.corpora_assumed = True  # stored before results format 4: nothing shows which corpora it read
        stored = dict(stored, **{CORPORA_KEY: unit.spec[CORPORA_KEY]})
    if on_disk.finished and stored is None:
        raise PlanError(
            f"{unit.dir.path} holds a finished unit but neither {unit.dir.spec.name} nor {unit.dir.meta.name} "
            "records its settings, so it cannot be matched to this run. Nothing was changed: use another "
            "--output, or delete that folder to redo it")
    if stored is not None and (on_disk.finished or on_disk.answered):
        differences = sorted(key for key in set(stored) | set(unit.spec) if stored.get(key) != unit.spec.get(key))
        if on_disk.finished and differences == [CORPORA_KEY]:
            # Only the embedded corpora changed: computed again, its files replaced once the new ones are stored.
            stored_corpora, asked_corpora = _differing(stored.get(CORPORA_KEY), unit.spec.get(CORPORA_KEY))
            unit.corpora_changed = sorted(set(stored_corpora or {}) | set(asked_corpora or {}))
            unit.finished = False
            return
        if differences:
            detail = "; ".join(
                "{}: stored {}, asked {}".format(key, *map(_short, _differing(stored.get(key), unit.spec.get(key))))
                for key in differences
            )
            raise PlanError(
                f"{unit.dir.path} holds a run with different settings ({detail}). Nothing was changed: "
                "use another --output, or delete that folder to redo it"
            )
    unit.finished = on_disk.finished


def _check_not_linked(unit: Unit) -> None:
    """PlanError when the unit's folder, or its model's folder, is a symbolic link."""
    for folder in (unit.dir.path.parent, unit.dir.path):
        if folder.is_symlink():
            raise PlanError(
                f"{folder} is a symbolic link (to {folder.readlink()}): `table`, `compare` and the other readers "
                "do not follow links, and a recompute would write into the linked folder. Nothing was changed: "
                f"replace the link by a copy of its target, or remove it to compute the unit here")


# What a unit's spec records since results format 3; units stored before lack it.
IDENTITY_SINCE_FORMAT_3 = ("task_definition", "versions")
# The sha256 of the embedded corpora a unit's task reads (fingerprints.embedded_corpora_fingerprint), recorded since
# results format 4; a finished unit that differs only in it is computed again rather than refused.
CORPORA_KEY = "embedded_corpora"


def _with_identity_of_old_units(unit: Unit, stored: dict[str, Any] | None) -> dict[str, Any] | None:
    """A spec stored before the task definition and versions were recorded is taken as asking this run's
    (nothing shows otherwise), marked identity_assumed for the plan's note; the data folder
    it may name is left out (its files' content is what the spec compares)."""
    if isinstance(stored, dict) and isinstance(stored.get("task_metadata"), dict):
        metadata = {key: value for key, value in stored["task_metadata"].items() if key not in FOLDER_METADATA_KEYS}
        stored = dict(stored, task_metadata=metadata)
    if stored is None or any(key in stored for key in IDENTITY_SINCE_FORMAT_3):
        return stored
    unit.identity_assumed = True  # plan_run's notes name these units once
    return stored | {key: unit.spec.get(key) for key in IDENTITY_SINCE_FORMAT_3 if key in unit.spec}


def _differing(stored: Any, asked: Any) -> tuple[Any, Any]:
    """Two settings with the entries they share left out (nested mappings too), so that a message shows the
    checkpoint file whose hash changed rather than the first one, which did not."""
    if not (isinstance(stored, dict) and isinstance(asked, dict)):
        return stored, asked
    pairs = {key: _differing(stored.get(key), asked.get(key)) for key in stored.keys() | asked.keys()
             if stored.get(key) != asked.get(key)}
    return ({key: pair[0] for key, pair in pairs.items() if key in stored},
            {key: pair[1] for key, pair in pairs.items() if key in asked})


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
