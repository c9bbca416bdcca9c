"""Planning a run: options -> validated units (model x lm-eval task), before any model is loaded.

A unit is one (model, lm-eval task) pair. Planning validates every option, resolves model and task
names and checks the output folder, so a bad command fails in a second; it imports neither torch
nor lm-eval.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.harness import results_store
from ccq_eval.harness.fingerprints import (  # noqa: F401  (re-exported: the runner checks them again)
    changed_since_planning,
    checkpoint_fingerprint,
    data_fingerprint,
    longbench_data_file,
    longbench_data_present,
)
from ccq_eval.harness.model_resolution import (  # noqa: F401  (DEFAULT_SWEEP_ATTACH re-exported)
    DEFAULT_SWEEP_ATTACH,
    ResolvedModels,
    resolve_models,
)
from ccq_eval.harness.options import (  # noqa: F401  (re-exported: what a plan is made from)
    LOGGER_ARGS,
    MANAGED_LMEVAL_ARGS,
    PlanError,
    attached_models,
    parse_ccq_attach,
    parse_depths,
    parse_lengths,
    parse_lm_eval_args,
    parse_shard,
    split_logger_args,
)
from ccq_eval.harness.results_store import UnitDir
from ccq_eval.harness.run_options import RunOptions, options_command_line  # noqa: F401  (re-exported)
from ccq_eval.harness.task_registry import RegistryTaskCatalog, TaskCatalog
from ccq_eval.model import registry as model_registry_module
from ccq_eval.model.registry import ModelEntry, RegistryError
from ccq_eval.task_families import FAMILY_METADATA_KEYS, PERPLEXITY, family_of

# The default run: small enough for a 2-core CPU in minutes on the embedded tiny models.
DEFAULT_TASKS = ["s-niah", "ppl"]
DEFAULT_LENGTHS = "1k,2k"
DEFAULT_DEPTHS = "0,50,100"
DEFAULT_SAMPLES_PER_CELL = 4
# The tasks of the default run's CCQ sweep (model_resolution.DEFAULT_SWEEP_ATTACH's lambdas).
DEFAULT_SWEEP_TASKS = ["s-niah-1", "s-niah-2", "ppl-sweep"]
DTYPE_CHOICES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}

# --------------------------------------------------------------------------------------------
# Defaults that fit the machine


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (imports torch; a function, so tests can fake a GPU)."""
    import torch

    return torch.cuda.is_available()


DEVICE_FORM = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def resolve_device(requested: str) -> str:
    """--device auto -> "cuda" when CUDA is present, else "cpu"; other values as given, except that
    under torchrun / accelerate launch with several processes "cuda" is this process's GPU
    (cuda:LOCAL_RANK), so the processes do not all load their model onto the first GPU. A device that
    is not one of auto, cpu, mps, cuda, cuda:N, or CUDA on a machine without it, is a PlanError."""
    if not DEVICE_FORM.match(str(requested)):
        raise PlanError(f"--device {requested!r} is not a device; give auto, cpu, cuda or cuda:N (mps on a "
                        "Mac)")
    device = requested
    if requested == "auto":
        device = "cuda" if cuda_available() else "cpu"
    elif device.startswith("cuda") and not cuda_available():
        raise PlanError(f"--device {requested}: torch sees no CUDA device on this machine; use --device cpu "
                        "(or auto, which takes CUDA where there is one)")
    if device == "cuda" and environment_int("WORLD_SIZE", 1) > 1:
        return f"cuda:{environment_int('LOCAL_RANK', 0)}"
    return device


def environment_int(name: str, default: int) -> int:
    """A whole number >= 0 that torchrun / accelerate launch set in the environment (RANK, WORLD_SIZE,
    LOCAL_RANK); `default` when it is unset."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise PlanError(f"environment variable {name}={text!r} is not a whole number >= 0: torchrun and "
                        f"accelerate launch set it; outside them unset it (`unset {name}`)")
    return int(text)


def data_parallel_ranks() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of this process, (0, 1) outside torchrun / accelerate launch. A RANK that is not
    below WORLD_SIZE (a RANK=1 left in the shell, without the launcher's WORLD_SIZE) is a PlanError:
    that process would evaluate and never write a result."""
    rank, world_size = environment_int("RANK", 0), environment_int("WORLD_SIZE", 1)
    if world_size < 1 or rank >= world_size:
        raise PlanError(f"environment variables RANK={rank} and WORLD_SIZE={world_size}: the rank must lie "
                        "below the world size; a RANK or WORLD_SIZE left from another launch? unset both "
                        "(`unset RANK WORLD_SIZE`) or start the run with torchrun / accelerate launch")
    return rank, world_size


def resolve_dtype(requested: str | None, device: str) -> str:
    """--dtype auto (or none) -> bfloat16 on CUDA, float32 elsewhere; aliases (bf16, fp32, ...) -> the
    torch name, so a unit's spec names one dtype one way."""
    if requested in (None, "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    return _DTYPE_NAMES.get(requested, requested)


# --------------------------------------------------------------------------------------------
# Suites: a fixed grid of tasks and lengths under one name (`run --suite NAME`)


@dataclass(frozen=True)
class SuitePart:
    """Task aliases of a suite with their length grid (empty: the tasks have none, LongBench)."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...] = ()
    past_training_context: bool = False  # add 2x the model's training context if the grid stays within it
    needs_longbench_data: bool = False  # only the datasets whose files --longbench-dir holds


@dataclass(frozen=True)
class Suite:
    description: str
    parts: tuple[SuitePart, ...]


SUITES: dict[str, Suite] = {
    "paper": Suite(
        "the papers' grid: S-NIAH-1/2/3 at 1K-8K (and past the model's training context), perplexity "
        "(both protocols) at 4K/8K/14K/20K, LongBench / LongBench-E datasets found in --longbench-dir",
        (SuitePart(("s-niah-1", "s-niah-2", "s-niah-3"), (1024, 2048, 4096, 8192), past_training_context=True),
         SuitePart(("ppl",), (4096, 8192, 14336, 20480)),
         SuitePart(("longbench", "longbench-e"), needs_longbench_data=True)),
    ),
}


def training_context(model: ModelEntry) -> int | None:
    """The context a local checkpoint was trained at, as its config.json records it
    (max_position_embeddings); None when there is no local config or no such field."""
    config = Path(model.source) / "config.json"
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def suite_lengths(part: SuitePart, model: ModelEntry) -> list[int]:
    """A part's lengths for one model: its grid, plus twice the training context when the grid
    never goes past it (so every model is also evaluated beyond what it was trained on)."""
    lengths = list(part.lengths)
    trained = training_context(model) if part.past_training_context else None
    if lengths and trained is not None and max(lengths) <= trained:
        lengths.append(2 * trained)
    return lengths


def default_task_catalog() -> TaskCatalog:
    """The task catalog commands use (a function, so tests can substitute one)."""
    return RegistryTaskCatalog()


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
    spec: dict[str, Any]
    finished: bool = False
    in_shard: bool = True  # False: another worker's part of the units (--shard)


@dataclass
class RunPlan:
    options: RunOptions
    units: list[Unit]
    lengths: list[int] | None
    depths: list[float] | None
    lm_eval_args: dict[str, Any]
    task_metadata: dict[str, Any]
    lm_eval_loggers: dict[str, dict[str, Any]] = field(default_factory=dict)  # split_logger_args
    device: str = "cpu"  # options.device resolved (resolve_device)
    dtype: str = "float32"  # options.dtype resolved (resolve_dtype)
    notes: list[str] = field(default_factory=list)  # what a suite left out, and why (shown to the user)

    @property
    def pending(self) -> list[Unit]:
        return [unit for unit in self.units if not unit.finished and unit.in_shard]


def metadata_for_task(task: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The part of the run's task metadata that can change `task`'s documents (its family's
    metadata_keys, and the keys no family is selective about).

    Keeping the rest out of the unit's spec lets a later run add, say, S-NIAH depths without
    the perplexity units counting as asked a different question."""
    keys = family_of(task).metadata_keys
    return {key: value for key, value in metadata.items() if key not in FAMILY_METADATA_KEYS or key in keys}


@dataclass
class Grid:
    """The lengths, depths and sample counts a run asks its tasks for, defaults filled in."""

    using_defaults: bool  # no --task and no --suite: the default tasks' small grid
    lengths: list[int] | None
    depths: list[float] | None
    samples_per_cell: int | None
    max_length: int | None  # --max-length, else the longest length


@dataclass
class RunTasks:
    """The lm-eval tasks of a run, each with the name it was asked by, and what was decided about them."""

    resolved: list[tuple[str, str]]
    sweep_tasks: list[tuple[str, str]]  # the default sweep models' tasks (DEFAULT_SWEEP_TASKS)
    part_of: dict[str, SuitePart]  # lm-eval task -> its suite part
    notes: list[str]


def plan_run(
    options: RunOptions,
    *,
    model_registry: dict[str, ModelEntry] | None = None,
    task_catalog: TaskCatalog | None = None,
) -> RunPlan:
    """Validate options and resolve names into units. Loads nothing; raises PlanError."""
    _check_options(options)
    evaluate_pairs, lm_eval_loggers = split_logger_args(options.lm_eval_args)
    lm_eval_args = parse_lm_eval_args(evaluate_pairs)
    _check_grid_text(options)
    shard = parse_shard(options.shard) if options.shard is not None else None
    attach = parse_ccq_attach(options.ccq_attach) if options.ccq_attach is not None else None
    if attach is not None and not options.models:
        raise PlanError("--ccq-attach needs --model: name the plain GLA / Gated DeltaNet checkpoints to attach "
                        "CCQ to (e.g. --model tiny-gla)")
    _check_output(options)
    grid = _grid(options)

    registry = load_model_registry() if model_registry is None else model_registry
    models = resolve_models(options, registry, attach, grid.using_defaults)
    catalog = default_task_catalog() if task_catalog is None else task_catalog
    tasks = _run_tasks(options, grid, catalog, with_sweep=bool(models.sweep_only))
    task_metadata = _task_metadata(options, grid)

    device = resolve_device(options.device)  # after every check above: this one may import torch
    if options.cuda_graphs and not device.startswith("cuda"):
        raise PlanError(f"--cuda-graphs needs a CUDA device; --device {options.device} gave {device} "
                        "(no CUDA device is visible); drop --cuda-graphs or run on a GPU")
    dtype = resolve_dtype(options.dtype, device)

    units = _build_units(options, grid, models, tasks, task_metadata, lm_eval_args, dtype)
    if shard is not None:
        index, count = shard
        for position, unit in enumerate(units):
            unit.in_shard = position % count == index - 1
    return RunPlan(
        options=options,
        units=units,
        lengths=grid.lengths,
        depths=grid.depths,
        lm_eval_args=lm_eval_args,
        lm_eval_loggers=lm_eval_loggers,
        task_metadata=task_metadata,
        device=device,
        dtype=dtype,
        notes=tasks.notes,
    )


def _check_options(options: RunOptions) -> None:
    """The options that are wrong on their own or together, before any name is resolved."""
    if options.limit is not None and options.samples_per_cell is not None:
        raise PlanError(
            "--limit and --samples-per-cell conflict: --limit takes the first N documents of a task "
            "across all lengths, --samples-per-cell sets N per (length, depth) cell; give one of them"
        )
    if options.limit is not None and options.limit <= 0:
        raise PlanError("--limit must be positive (a count, or a fraction below 1)")
    if options.samples_per_cell is not None and options.samples_per_cell <= 0:
        raise PlanError("--samples-per-cell must be a positive whole number")
    if options.batch_size is not None and options.batch_size <= 0:
        raise PlanError("--batch-size must be a positive whole number")
    if options.max_length is not None and options.max_length <= 0:
        raise PlanError("--max-length must be a positive number of tokens")
    if not 0 <= options.seed < 2**32:
        raise PlanError(f"--seed {options.seed} is out of range: give a whole number from 0 to {2**32 - 1} "
                        "(numpy's seed range, which lm-eval seeds too)")
    data_parallel_ranks()
    if options.dtype is not None and options.dtype not in DTYPE_CHOICES:
        raise PlanError(f"--dtype {options.dtype!r}: valid choices are {', '.join(DTYPE_CHOICES)}")
    if options.cuda_graphs and options.device != "auto" and not str(options.device).startswith("cuda"):
        raise PlanError(f"--cuda-graphs needs a CUDA device (--device cuda); got --device {options.device}")
    if options.suite is not None:
        if options.suite not in SUITES:
            raise PlanError(f"--suite {options.suite!r}: valid suites are {', '.join(SUITES)}")
        given = [flag for flag, value in (("--task", options.tasks), ("--lengths", options.lengths),
                                          ("--limit", options.limit)) if value]
        if given:
            raise PlanError(f"--suite {options.suite} sets the tasks and lengths itself; drop {', '.join(given)} "
                            "(or run without --suite)")
    if options.longbench_dir is not None and not Path(options.longbench_dir).is_dir():
        raise PlanError(f"--longbench-dir {options.longbench_dir}: no such folder")


def _check_grid_text(options: RunOptions) -> None:
    for flag, text in (("--lengths", options.lengths), ("--depths", options.depths)):
        if text is not None and not text.strip(" ,"):
            raise PlanError(f"{flag} is empty; give comma-separated values (e.g. --lengths 1k,2k --depths 0,50,100) "
                            "or leave the option out for the defaults")


def _check_output(options: RunOptions) -> None:
    output = Path(options.output)
    for folder in (output, *output.parents):
        if folder.exists() and not folder.is_dir():
            raise PlanError(f"--output {options.output}: {folder} is a file, not a folder; give a folder path")


def _grid(options: RunOptions) -> Grid:
    """--lengths, --depths and --samples-per-cell parsed, with the default run's small grid where no
    --task or --suite is given."""
    using_defaults = not options.tasks and options.suite is None
    lengths_text = options.lengths if options.lengths is not None else (DEFAULT_LENGTHS if using_defaults else None)
    depths_text = options.depths if options.depths is not None else (DEFAULT_DEPTHS if using_defaults else None)
    samples_per_cell = options.samples_per_cell
    if using_defaults and samples_per_cell is None and options.limit is None:
        samples_per_cell = DEFAULT_SAMPLES_PER_CELL
    lengths = parse_lengths(lengths_text) if lengths_text else None
    depths = parse_depths(depths_text) if depths_text else None
    max_length = options.max_length or (max(lengths) if lengths else None)
    if options.max_length and lengths and options.max_length < max(lengths):
        raise PlanError(
            f"--max-length {options.max_length} is shorter than the longest of --lengths ({max(lengths)}); "
            "raise --max-length or drop the longer lengths"
        )
    return Grid(using_defaults, lengths, depths, samples_per_cell, max_length)


def _run_tasks(options: RunOptions, grid: Grid, catalog: TaskCatalog, with_sweep: bool) -> RunTasks:
    """The run's tasks (--task, a suite's or the defaults) resolved, and the options checked against their
    families (ccq_eval.task_families)."""
    suite = SUITES[options.suite] if options.suite is not None else None
    task_names = [a for part in suite.parts for a in part.tasks] if suite else list(options.tasks or DEFAULT_TASKS)
    resolved = _resolve_tasks(task_names, catalog)  # (lm-eval task, as the user wrote it)
    sweep_tasks = [pair for pair in _resolve_tasks(DEFAULT_SWEEP_TASKS, catalog) if pair[0] in dict(resolved)] \
        if with_sweep else []
    notes: list[str] = []
    part_of: dict[str, SuitePart] = {}
    if suite is not None:
        for part in suite.parts:
            for task, alias in resolved:
                if alias in part.tasks:
                    part_of[task] = part
        resolved, notes = _suite_tasks_with_data(resolved, part_of, options)
    if grid.depths is not None and not any(family_of(task).takes_depths for task, _ in resolved):
        raise PlanError("--depths applies to S-NIAH tasks only, and no S-NIAH task was selected")
    grid_tasks = [task for task, _ in resolved if family_of(task).length_grid]
    if options.limit is not None and grid_tasks:
        raise PlanError(
            f"--limit takes the first N documents, which for {grid_tasks[0]} are the shortest lengths only; "
            "use --samples-per-cell for S-NIAH and perplexity tasks (and --limit in a separate LongBench run)"
        )
    longbench_tasks = [task for task, _ in resolved if family_of(task).needs_longbench_data]
    if options.samples_per_cell is not None and longbench_tasks and options.suite is None:
        raise PlanError(
            "--samples-per-cell does not apply to LongBench (fixed datasets); run LongBench separately "
            "and use --limit N to evaluate its first N records per dataset"
        )
    _check_longbench_data(longbench_tasks, options.longbench_dir)
    ppl_tasks = [task for task, _ in resolved if family_of(task) is PERPLEXITY]
    if ppl_tasks and grid.samples_per_cell is None and options.suite is None:
        notes.append(f"note: {', '.join(ppl_tasks)} without --samples-per-cell scores every document of the "
                     "eval split at each length (tens of minutes on a CPU); --samples-per-cell 4 makes a quick "
                     "run")
    return RunTasks(resolved, sweep_tasks, part_of, notes)


def _task_metadata(options: RunOptions, grid: Grid) -> dict[str, Any]:
    """The metadata every task of the run is given (each unit's spec records its family's part of it)."""
    task_metadata: dict[str, Any] = {"seed": options.seed}
    if grid.lengths is not None:
        task_metadata["lengths"] = grid.lengths
    if grid.depths is not None:
        task_metadata["depths"] = grid.depths
    if grid.samples_per_cell is not None:
        task_metadata["samples_per_cell"] = grid.samples_per_cell
    if options.longbench_dir is not None:
        task_metadata["data_dir"] = str(Path(options.longbench_dir).resolve())  # tasks/longbench's key
    return task_metadata


def _build_units(options: RunOptions, grid: Grid, models: ResolvedModels, tasks: RunTasks,
                 task_metadata: dict[str, Any], lm_eval_args: dict[str, Any], dtype: str) -> list[Unit]:
    """One unit per (model, task), its spec in the form it has once stored, checked against its folder."""
    units = []
    for model in models.models:
        fingerprint = checkpoint_fingerprint(model.source)
        for task, requested_as in (tasks.sweep_tasks if model.name in models.sweep_only else tasks.resolved):
            unit_metadata, unit_max_length = task_metadata, grid.max_length
            if task in tasks.part_of and tasks.part_of[task].lengths:
                unit_lengths = suite_lengths(tasks.part_of[task], model)
                if options.max_length and options.max_length < max(unit_lengths):
                    raise PlanError(f"--max-length {options.max_length} is shorter than {task}'s longest length "
                                    f"in --suite {options.suite} ({max(unit_lengths)}); raise or drop --max-length")
                unit_metadata = dict(task_metadata, lengths=unit_lengths)
                unit_max_length = options.max_length or max(unit_lengths)
            spec = {  # what the unit computes; a folder's location is not part of it (meta.json has it)
                "model": model.name,
                "checkpoint": fingerprint,
                "task": task,
                "task_metadata": metadata_for_task(task, unit_metadata),
                "limit": options.limit,
                "dtype": dtype,
                "max_length": unit_max_length,
                "lm_eval_args": lm_eval_args,
            }
            if model.name in models.attachments:
                spec["ccq_attach"] = models.attachments[model.name]
            data_files = data_fingerprint(task, spec["task_metadata"])
            if data_files is not None:
                spec["data_files"] = data_files
            spec = json.loads(results_store.dumps(spec))  # the form it has once stored
            unit = Unit(
                model=model.name,
                model_source=model.source,
                task=task,
                requested_as=requested_as,
                dir=results_store.unit_dir(options.output, model.name, task),
                spec=spec,
            )
            check_against_disk(unit)
            units.append(unit)
    return units


def _resolve_tasks(names: list[str], catalog: TaskCatalog) -> list[tuple[str, str]]:
    """Task aliases or lm-eval names -> (lm-eval task, the name it was asked by), each task once."""
    resolved: list[tuple[str, str]] = []
    for name in names:
        try:
            expanded = catalog.resolve(name)
        except KeyError as exc:
            message = str(exc)
            if type(exc) is KeyError:  # a bare KeyError: list the choices ourselves
                choices = ", ".join(sorted(catalog.aliases()))
                message = (f"unknown task {name!r}; valid choices: {choices} (or an lm-eval task name "
                           "from `lm-eval ls tasks`)")
            raise PlanError(message) from None
        for task in expanded:
            if task not in [t for t, _ in resolved]:
                resolved.append((task, name))
    return resolved


def _suite_tasks_with_data(resolved: list[tuple[str, str]], part_of: dict[str, SuitePart],
                           options: RunOptions) -> tuple[list[tuple[str, str]], list[str]]:
    """A suite's tasks without the LongBench datasets whose data is absent, and notes saying so."""
    data_dir = Path(options.longbench_dir) if options.longbench_dir is not None else None
    kept = [(task, alias) for task, alias in resolved
            if not part_of[task].needs_longbench_data or (data_dir and longbench_data_present(task, data_dir))]
    dropped = sorted({alias for task, alias in resolved if (task, alias) not in kept})
    notes = []
    if dropped and data_dir is None:
        notes.append(f"--suite {options.suite}: {', '.join(dropped)} skipped (no --longbench-dir)")
    elif dropped:
        missing = len(resolved) - len(kept)
        notes.append(f"--suite {options.suite}: {missing} {'/'.join(dropped)} datasets skipped "
                     f"(no jsonl file in {data_dir})")
    return kept, notes


def _check_longbench_data(tasks: list[str], data_dir: Path | None) -> None:
    """LongBench reads the official jsonl files: their folder must be given and hold every file asked for."""
    if not tasks:
        return
    if data_dir is None:
        raise PlanError(f"{tasks[0]} needs the LongBench data: pass --longbench-dir FOLDER holding the official "
                        "jsonl files (the unzipped data.zip of the hub dataset THUDM/LongBench)")
    folder = Path(data_dir).expanduser()
    missing = [task for task in tasks if task.startswith("ccq_longbench_") and not longbench_data_present(task, folder)]
    if missing:
        raise PlanError(f"--longbench-dir {data_dir} lacks the jsonl file of {', '.join(missing[:3])}"
                        f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (looked in it and its "
                        "data/ subfolder): unzip THUDM/LongBench's data.zip there, or choose fewer tasks")


def check_against_disk(unit: Unit) -> None:
    """A unit folder from an earlier run must have been asked the same question (a folder whose run
    failed before answering anything is free to take), and its files must be readable.

    A finished unit's question is its unit.json, else the copy in meta.json; a finished unit with
    neither cannot show what produced its numbers and is refused rather than taken for this one."""
    finished = unit.dir.results.is_file()
    try:
        meta = None
        if finished:
            results_store.read_json(unit.dir.results)
            meta = results_store.read_json(unit.dir.meta) if unit.dir.meta.is_file() else None
            if meta is not None and not isinstance(meta, dict):
                raise PlanError(f"{unit.dir.meta} should hold a JSON object; fix or delete it")
            answered = None
        else:
            answered = results_store.answered_count(unit.dir.responses_db)
        stored = results_store.read_json(unit.dir.spec) if unit.dir.spec.is_file() else None
    except results_store.ResultsError as exc:
        raise PlanError(str(exc)) from None
    if finished and stored is None:
        stored = meta.get("spec") if meta is not None else None
        if not isinstance(stored, dict):
            raise PlanError(
                f"{unit.dir.path} holds a finished unit but neither {results_store.UNIT_SPEC_FILE} nor "
                f"{results_store.META_FILE} records its settings, so it cannot be matched to this run. Nothing "
                "was changed: use another --output, or delete that folder to redo it")
    if stored is not None:
        if "dtype" in stored:  # stored before dtypes were resolved: None was float32, aliases their name
            stored = dict(stored, dtype=resolve_dtype(stored["dtype"] or "float32", "cpu"))
        differences = sorted(
            key for key in set(stored) | set(unit.spec) if stored.get(key) != unit.spec.get(key)
        )
        if differences and (finished or answered):
            detail = "; ".join(
                "{}: stored {}, asked {}".format(key, *map(_short, _differing(stored.get(key),
                                                                              unit.spec.get(key))))
                for key in differences
            )
            raise PlanError(
                f"{unit.dir.path} holds a run with different settings ({detail}). Nothing was changed: "
                "use another --output, or delete that folder to redo it"
            )
    unit.finished = finished


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


def load_model_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    """The model registry (ccq_eval.model.registry), its errors as PlanError."""
    try:
        return model_registry_module.load_model_registry(path)
    except RegistryError as exc:
        raise PlanError(str(exc)) from None
