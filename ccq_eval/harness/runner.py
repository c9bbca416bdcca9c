"""Run orchestration: plan (models x tasks x lengths) -> one lm-eval evaluation per unit -> store.

A unit is one (model, lm-eval task) pair. Planning validates every option, resolves model
and task names and checks the output folder before any model is loaded, so a bad command
fails in a second. Execution skips finished units, resumes an interrupted one from its
response cache (see results_store.ResponseCache) and stores each finished unit atomically.

The unit evaluator is injectable (`EvaluateUnit`): the default one loads the model, wraps
it in the lm-eval adapter and calls lm_eval.simple_evaluate; tests pass fakes.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ccq_eval import results_store
from ccq_eval.results_store import ResponseCache, UnitDir

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_REGISTRY_PATH = REPO_ROOT / "models" / "registry.json"

# The default run: small enough for a 2-core CPU in minutes on the embedded tiny models.
DEFAULT_TASKS = ["s-niah", "ppl"]
DEFAULT_LENGTHS = "1k,2k"
DEFAULT_DEPTHS = "0,50,100"
DEFAULT_SAMPLES_PER_CELL = 2
DTYPE_CHOICES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")
FALLBACK_DEFAULT_MODELS = ["tiny-gla", "tiny-gla-ccq", "tiny-gdn", "tiny-gdn-ccq"]

# simple_evaluate arguments the runner sets itself; --lm-eval-arg may not override them.
MANAGED_LMEVAL_ARGS = {
    "model": "--model",
    "model_args": "--model",
    "tasks": "--task",
    "task_manager": "--task",
    "batch_size": "--batch-size",
    "max_batch_size": "--batch-size",
    "device": "--device",
    "limit": "--limit",
    "samples": "--limit",
    "use_cache": "(the runner's own per-unit resume cache)",
    "log_samples": "(samples are always logged)",
    "random_seed": "--seed",
    "numpy_random_seed": "--seed",
    "torch_random_seed": "--seed",
    "fewshot_random_seed": "--seed",
    "evaluation_tracker": "--output",
    "metadata": "--lengths / --depths / --samples-per-cell",
    "verbosity": "(not a result setting)",
    "predict_only": "(metrics are always computed)",
}


class PlanError(Exception):
    """A bad command (unknown name, unparseable or conflicting options); nothing was loaded."""


# --------------------------------------------------------------------------------------------
# Parsing options


_LENGTH_TOKEN = re.compile(r"^(?P<number>\d+(?:\.\d+)?)(?P<unit>[kKmM]?)$")


def parse_lengths(text: str) -> list[int]:
    """'1k,2k,4k' -> [1024, 2048, 4096]; plain numbers are token counts (k = 1024, as RULER)."""
    lengths = []
    for token in [t.strip() for t in text.split(",")]:
        match = _LENGTH_TOKEN.match(token)
        if not match:
            raise PlanError(
                f"--lengths: cannot parse {token!r} in {text!r}; give comma-separated token counts "
                "such as 1k,2k,4k or 1024,2048"
            )
        scale = {"": 1, "k": 1024, "m": 1024 * 1024}[match["unit"].lower()]
        value = float(match["number"]) * scale
        if value != int(value) or value <= 0:
            raise PlanError(f"--lengths: {token!r} is not a positive whole number of tokens")
        lengths.append(int(value))
    if len(set(lengths)) != len(lengths):
        raise PlanError(f"--lengths: {text!r} repeats a length")
    return sorted(lengths)


def parse_depths(text: str) -> list[float]:
    """'0,50,100' -> [0.0, 50.0, 100.0]: needle depths in percent of the haystack."""
    depths = []
    for token in [t.strip().rstrip("%") for t in text.split(",")]:
        try:
            value = float(token)
        except ValueError:
            raise PlanError(
                f"--depths: cannot parse {token!r} in {text!r}; give comma-separated percentages "
                "in [0, 100] such as 0,25,50,75,100"
            ) from None
        if not 0 <= value <= 100:
            raise PlanError(f"--depths: {token!r} is outside [0, 100]")
        depths.append(value)
    if len(set(depths)) != len(depths):
        raise PlanError(f"--depths: {text!r} repeats a depth")
    return sorted(depths)


def _parse_scalar(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_lm_eval_args(pairs: Sequence[str]) -> dict[str, Any]:
    """['bootstrap_iters=1000', ...] -> {'bootstrap_iters': 1000}; keys checked against simple_evaluate."""
    allowed = _simple_evaluate_parameters()
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise PlanError(f"--lm-eval-arg {pair!r}: expected key=value, e.g. bootstrap_iters=1000")
        if key in MANAGED_LMEVAL_ARGS:
            raise PlanError(f"--lm-eval-arg {key}: set by the runner; use {MANAGED_LMEVAL_ARGS[key]} instead")
        if allowed is not None and key not in allowed:
            choices = ", ".join(sorted(allowed - set(MANAGED_LMEVAL_ARGS)))
            raise PlanError(f"--lm-eval-arg {key}: not an lm_eval.simple_evaluate argument; valid: {choices}")
        parsed[key] = _parse_scalar(value.strip())
    return parsed


def _simple_evaluate_parameters() -> set[str] | None:
    try:
        from lm_eval import evaluator
    except ImportError:  # pragma: no cover - lm-eval is a dependency
        return None
    return set(inspect.signature(evaluator.simple_evaluate).parameters)


# --------------------------------------------------------------------------------------------
# What can be run: models and tasks


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # what ccq_eval.loading.load_model receives
    description: str = ""
    default: bool = False


def load_model_registry(path: Path | None = None) -> dict[str, ModelEntry]:
    """models/registry.json as {name: ModelEntry}; an absent file gives an empty registry.

    Format (ccq_eval.loading): {name: {"path": <folder, relative to models/>, "description",
    "default": bool}}; a list of {"name", "path", ...} is accepted too.
    """
    path = Path(MODEL_REGISTRY_PATH if path is None else path)
    if not path.is_file():
        return {}
    try:
        raw = results_store.read_json(path)
    except results_store.ResultsError as exc:
        raise PlanError(str(exc)) from None
    entries = raw.get("models", raw) if isinstance(raw, dict) else raw
    if isinstance(entries, dict):
        items = [dict(value, name=key) if isinstance(value, dict) else {"name": key, "path": value}
                 for key, value in entries.items()]
    elif isinstance(entries, list):
        items = [dict(item) for item in entries]
    else:
        raise PlanError(f"{path}: expected a JSON object or list of models")
    registry = {}
    for item in items:
        name = str(item["name"])
        source = item.get("path") or item.get("source") or item.get("checkpoint") or name
        if not Path(str(source)).is_absolute() and (Path(path).parent / str(source)).exists():
            source = str((Path(path).parent / str(source)).resolve())
        elif not Path(str(source)).is_absolute() and (REPO_ROOT / str(source)).exists():
            source = str((REPO_ROOT / str(source)).resolve())
        registry[name] = ModelEntry(
            name=name,
            source=str(source),
            description=str(item.get("description", "")),
            default=bool(item.get("default", False)),
        )
    return registry


def default_model_names(registry: dict[str, ModelEntry]) -> list[str]:
    flagged = [entry.name for entry in registry.values() if entry.default]
    return flagged or [name for name in FALLBACK_DEFAULT_MODELS if name in registry]


class TaskCatalog(Protocol):
    """What the runner needs from the task registry."""

    def aliases(self) -> dict[str, str]:
        """User-facing task names (aliases and our lm-eval tasks) -> one-line description."""

    def resolve(self, name: str) -> list[str]:
        """An alias or lm-eval task name -> lm-eval task names; KeyError when unknown."""

    def make_task_manager(self, metadata: dict[str, Any]) -> Any:
        """An lm_eval TaskManager that knows our tasks, with `metadata` for every task."""


class RegistryTaskCatalog:
    """TaskCatalog over ccq_eval.task_registry (helper "adapter")."""

    def __init__(self) -> None:
        self._module = importlib.import_module("ccq_eval.task_registry")

    def aliases(self) -> dict[str, str]:
        return dict(self._module.list_tasks())

    def resolve(self, name: str) -> list[str]:
        return list(self._module.resolve_tasks([name]))

    def make_task_manager(self, metadata: dict[str, Any]) -> Any:
        return self._module.make_task_manager(metadata=metadata)


def default_task_catalog() -> TaskCatalog:
    """The task catalog commands use (a function, so tests can substitute one)."""
    return RegistryTaskCatalog()


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class RunOptions:
    models: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    lengths: str | None = None
    depths: str | None = None
    samples_per_cell: int | None = None
    limit: float | None = None
    device: str = "cpu"
    dtype: str | None = None
    batch_size: int = 1
    max_length: int | None = None
    seed: int = 0
    output: Path = Path("results/latest")
    lm_eval_args: list[str] = field(default_factory=list)
    longbench_dir: Path | None = None
    keep_going: bool = False
    cuda_graphs: bool = False  # the adapter's CUDA-graph decode steps and scoring forwards


def options_command_line(options: RunOptions) -> list[str]:
    """The `ccq-eval run` command that reproduces `options` (stored in every unit's meta.json)."""
    argv = ["ccq-eval", "run"]
    for model in options.models:
        argv += ["--model", model]
    for task in options.tasks:
        argv += ["--task", task]
    for flag, value in (("--lengths", options.lengths), ("--depths", options.depths),
                        ("--samples-per-cell", options.samples_per_cell), ("--limit", options.limit),
                        ("--dtype", options.dtype), ("--max-length", options.max_length),
                        ("--longbench-dir", options.longbench_dir)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--device", options.device, "--batch-size", str(options.batch_size), "--seed", str(options.seed),
             "--output", str(options.output)]
    for pair in options.lm_eval_args:
        argv += ["--lm-eval-arg", pair]
    if options.keep_going:
        argv.append("--keep-going")
    if options.cuda_graphs:
        argv.append("--cuda-graphs")
    return argv


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


@dataclass
class RunPlan:
    options: RunOptions
    units: list[Unit]
    lengths: list[int] | None
    depths: list[float] | None
    lm_eval_args: dict[str, Any]
    task_metadata: dict[str, Any]

    @property
    def pending(self) -> list[Unit]:
        return [unit for unit in self.units if not unit.finished]


def _is_sniah(task: str) -> bool:
    return "s_niah" in task or "sniah" in task


def metadata_for_task(task: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The part of the run's task metadata that can change `task`'s documents.

    Keeping the rest out of the unit's spec lets a later run add, say, S-NIAH depths without
    the perplexity units counting as asked a different question."""
    relevant = dict(metadata)
    if not _is_sniah(task):
        relevant.pop("depths", None)
    if "longbench" in task:
        relevant.pop("lengths", None)  # LongBench's budget is max_length
        relevant.pop("samples_per_cell", None)
    else:
        relevant.pop("data_dir", None)
    return relevant


_FINGERPRINT_BYTES = 1 << 20


def _weights_fingerprint(path: Path) -> str:
    """sha256 of a weight file's size, first MiB and last MiB: changes when a checkpoint is
    retrained (the embeddings come first), costs milliseconds even for multi-GB files."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(_FINGERPRINT_BYTES))
        if size > 2 * _FINGERPRINT_BYTES:
            handle.seek(size - _FINGERPRINT_BYTES)
            digest.update(handle.read())
    return digest.hexdigest()


def _checkpoint_fingerprint(source: str) -> dict[str, Any] | None:
    """Identity of a local checkpoint folder, so a resumed unit never mixes two checkpoints."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    config = folder / "config.json"
    return {
        "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
        "weights_head_tail_sha256": {p.name: _weights_fingerprint(p) for p in sorted(folder.glob("*.safetensors"))},
    }


def _looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")


def plan_run(
    options: RunOptions,
    *,
    model_registry: dict[str, ModelEntry] | None = None,
    task_catalog: TaskCatalog | None = None,
) -> RunPlan:
    """Validate options and resolve names into units. Loads nothing; raises PlanError."""
    if options.limit is not None and options.samples_per_cell is not None:
        raise PlanError(
            "--limit and --samples-per-cell conflict: --limit takes the first N documents of a task "
            "across all lengths, --samples-per-cell sets N per (length, depth) cell; give one of them"
        )
    if options.limit is not None and options.limit <= 0:
        raise PlanError("--limit must be positive (a count, or a fraction below 1)")
    if options.samples_per_cell is not None and options.samples_per_cell <= 0:
        raise PlanError("--samples-per-cell must be a positive whole number")
    if options.batch_size <= 0:
        raise PlanError("--batch-size must be a positive whole number")
    if options.max_length is not None and options.max_length <= 0:
        raise PlanError("--max-length must be a positive number of tokens")
    if options.dtype is not None and options.dtype not in DTYPE_CHOICES:
        raise PlanError(f"--dtype {options.dtype!r}: valid choices are {', '.join(DTYPE_CHOICES)}")
    if options.cuda_graphs and not str(options.device).startswith("cuda"):
        raise PlanError(f"--cuda-graphs needs a CUDA device (--device cuda); got --device {options.device}")
    if options.longbench_dir is not None and not Path(options.longbench_dir).is_dir():
        raise PlanError(f"--longbench-dir {options.longbench_dir}: no such folder")
    lm_eval_args = parse_lm_eval_args(options.lm_eval_args)

    using_defaults = not options.tasks  # the default tasks come with the default small grid
    lengths_text = options.lengths or (DEFAULT_LENGTHS if using_defaults else None)
    depths_text = options.depths or (DEFAULT_DEPTHS if using_defaults else None)
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

    registry = load_model_registry() if model_registry is None else model_registry
    model_names = list(options.models) or default_model_names(registry)
    if not model_names:
        raise PlanError(
            f"no --model given and no default models in {MODEL_REGISTRY_PATH}; "
            "give --model NAME (a registry name or a checkpoint folder)"
        )
    models: list[ModelEntry] = []
    for name in model_names:
        if name in registry:
            models.append(registry[name])
        elif Path(name).expanduser().is_dir():
            folder = Path(name).expanduser().resolve()
            models.append(ModelEntry(name=folder.name, source=str(folder)))
        elif _looks_like_hub_id(name) and not _hub_offline():
            models.append(ModelEntry(name=name.replace("/", "__"), source=name))
        else:
            choices = ", ".join(sorted(registry)) or "(the registry is empty)"
            hub = " (hub ids need HF_HUB_OFFLINE unset)" if _looks_like_hub_id(name) else ""
            raise PlanError(
                f"unknown model {name!r}: give a registered name ({choices}) or an existing checkpoint "
                f"folder{hub}; `ccq-eval models` lists the registered ones"
            )
    labels = [m.name for m in models]
    if len(set(labels)) != len(labels):
        raise PlanError(f"--model names the same model twice: {', '.join(labels)}")

    catalog = default_task_catalog() if task_catalog is None else task_catalog
    task_names = list(options.tasks) or list(DEFAULT_TASKS)
    resolved: list[tuple[str, str]] = []  # (lm-eval task, as the user wrote it)
    for name in task_names:
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
    if depths is not None and not any(_is_sniah(task) for task, _ in resolved):
        raise PlanError("--depths applies to S-NIAH tasks only, and no S-NIAH task was selected")
    grid_tasks = [task for task, _ in resolved if _is_sniah(task) or task.startswith("ccq_ppl")]
    if options.limit is not None and grid_tasks:
        raise PlanError(
            f"--limit takes the first N documents, which for {grid_tasks[0]} are the shortest lengths only; "
            "use --samples-per-cell for S-NIAH and perplexity tasks (and --limit in a separate LongBench run)"
        )
    longbench_tasks = [task for task, _ in resolved if "longbench" in task]
    if options.samples_per_cell is not None and longbench_tasks:
        raise PlanError(
            "--samples-per-cell does not apply to LongBench (fixed datasets); run LongBench separately "
            "and use --limit N to evaluate its first N records per dataset"
        )

    task_metadata: dict[str, Any] = {"seed": options.seed}
    if lengths is not None:
        task_metadata["lengths"] = lengths
    if depths is not None:
        task_metadata["depths"] = depths
    if samples_per_cell is not None:
        task_metadata["samples_per_cell"] = samples_per_cell
    if options.longbench_dir is not None:
        task_metadata["data_dir"] = str(Path(options.longbench_dir).resolve())  # tasks/longbench's key

    units = []
    for model in models:
        fingerprint = _checkpoint_fingerprint(model.source)
        for task, requested_as in resolved:
            spec = {  # what the unit computes; a folder's location is not part of it (meta.json has it)
                "model": model.name,
                "checkpoint": fingerprint,
                "task": task,
                "task_metadata": metadata_for_task(task, task_metadata),
                "limit": options.limit,
                "dtype": options.dtype,
                "max_length": max_length,
                "lm_eval_args": lm_eval_args,
            }
            spec = json.loads(results_store.dumps(spec))  # the form it has once stored
            unit = Unit(
                model=model.name,
                model_source=model.source,
                task=task,
                requested_as=requested_as,
                dir=results_store.unit_dir(options.output, model.name, task),
                spec=spec,
            )
            _check_against_disk(unit)
            units.append(unit)
    return RunPlan(
        options=options,
        units=units,
        lengths=lengths,
        depths=depths,
        lm_eval_args=lm_eval_args,
        task_metadata=task_metadata,
    )


def _check_against_disk(unit: Unit) -> None:
    """A unit folder from an earlier run must have been asked the same question."""
    if unit.dir.spec.is_file():
        try:
            stored = results_store.read_json(unit.dir.spec)
        except results_store.ResultsError as exc:
            raise PlanError(str(exc)) from None
        differences = sorted(
            key for key in set(stored) | set(unit.spec) if stored.get(key) != unit.spec.get(key)
        )
        if differences:
            detail = "; ".join(
                f"{key}: stored {stored.get(key)!r}, asked {unit.spec.get(key)!r}" for key in differences
            )
            raise PlanError(
                f"{unit.dir.path} holds a run with different settings ({detail}). Nothing was changed: "
                "use another --output, or delete that folder to redo it"
            )
    if unit.dir.results.is_file():
        try:
            results_store.read_json(unit.dir.results)
        except results_store.ResultsError as exc:
            raise PlanError(str(exc)) from None
        unit.finished = True


# --------------------------------------------------------------------------------------------
# Progress reporting


class Reporter(Protocol):
    def run_start(self, plan: RunPlan) -> None: ...
    def unit_start(self, unit: Unit, index: int, total: int) -> None: ...
    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None: ...
    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None: ...
    def run_end(self) -> None: ...


class SilentReporter:
    def run_start(self, plan: RunPlan) -> None:
        pass

    def unit_start(self, unit: Unit, index: int, total: int) -> None:
        pass

    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None:
        pass

    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None:
        pass

    def run_end(self) -> None:
        pass


class RichReporter:
    """Two progress bars: units of the run, and requests of the current unit (with its cell)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),  # names and cells may hold [ ]
            TextColumn("{task.fields[cell]}", style="cyan", markup=False),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._units_bar: Any = None
        self._requests_bar: Any = None

    def run_start(self, plan: RunPlan) -> None:
        self.progress.start()
        skipped = len(plan.units) - len(plan.pending)
        self._units_bar = self.progress.add_task(
            "units", total=len(plan.units), completed=skipped, cell=f"({skipped} already done)"
        )

    def unit_start(self, unit: Unit, index: int, total: int) -> None:
        if self._requests_bar is not None:
            self.progress.remove_task(self._requests_bar)
        self._requests_bar = self.progress.add_task(f"{unit.model} / {unit.task}", total=None, cell="")

    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None:
        self.progress.update(self._requests_bar, completed=done, total=total, cell=f"[{cell}]" if cell else "")

    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None:
        self.progress.advance(self._units_bar)
        message = f"{status}: {unit.model} / {unit.task}" + (f" ({detail})" if detail else "")
        self.progress.console.print(message, markup=False, highlight=False)

    def run_end(self) -> None:
        self.progress.stop()


# --------------------------------------------------------------------------------------------
# The resumable LM wrapper


_LENGTH_KEYS = ("length", "max_length", "seq_length", "context_length", "target_length")
_DEPTH_KEYS = ("depth", "depth_percent", "needle_depth")


def describe_cell(doc: Any) -> str:
    """'len 2048, depth 50' from an S-NIAH / ppl doc, '' when the doc names no cell."""
    if not isinstance(doc, dict):
        return ""
    parts = []
    for label, keys in (("len", _LENGTH_KEYS), ("depth", _DEPTH_KEYS)):
        for key in keys:
            if key in doc and doc[key] is not None:
                value = doc[key]
                parts.append(f"{label} {value:g}" if isinstance(value, float) else f"{label} {value}")
                break
    return ", ".join(parts)


# Float subclasses a rolling loglikelihood may return, rebuilt on resume (no pickle: listed here).
def _token_nll_type() -> type | None:
    try:
        return importlib.import_module("ccq_eval.lm_adapter").TokenNLL
    except (ImportError, AttributeError):
        return None


def encode_response(request_type: str, response: Any) -> Any:
    if request_type == "generate_until":
        return {"text": str(response)}
    if request_type == "loglikelihood":
        logprob, is_greedy = response
        return {"logprob": float(logprob), "greedy": bool(is_greedy)}
    if request_type == "loglikelihood_rolling":
        encoded: dict[str, Any] = {"logprob": float(response)}
        token_nll = getattr(response, "token_nll", None)
        if token_nll is not None:
            encoded["token_nll"] = [float(x) for x in token_nll]
        return encoded
    raise ValueError(f"unknown lm-eval request type {request_type!r}")


def decode_response(request_type: str, stored: Any) -> Any:
    if request_type == "generate_until":
        return stored["text"]
    if request_type == "loglikelihood":
        return (stored["logprob"], stored["greedy"])
    if request_type == "loglikelihood_rolling":
        if "token_nll" in stored:
            token_nll_type = _token_nll_type()
            if token_nll_type is None:
                raise RuntimeError("cached per-token NLLs need ccq_eval.lm_adapter.TokenNLL, which is missing")
            return token_nll_type(stored["logprob"], stored["token_nll"])  # the stored float exactly
        return stored["logprob"]
    raise ValueError(f"unknown lm-eval request type {request_type!r}")


def _lm_base() -> type:
    from lm_eval.api.model import LM

    return LM


class ResumableLM(_lm_base()):  # type: ignore[misc]
    """Wraps an lm-eval LM: answers known requests from the unit's ResponseCache, sends the
    rest to the model in chunks of `chunk_size`, committing each chunk's responses at once.

    A run killed mid-unit therefore keeps every answered chunk, and the rerun evaluates
    only what is missing. Also reports progress per chunk.
    """

    def __init__(
        self,
        inner: Any,
        cache: ResponseCache,
        *,
        chunk_size: int = 1,
        on_progress: Callable[[int, int, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.cache = cache
        self.chunk_size = max(1, int(chunk_size))
        self.on_progress = on_progress
        self.cached_count = 0
        self.computed_count = 0

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the wrapper lacks: tokenizer_name, get_model_info, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        return getattr(self.inner, "rank", 0)

    @property
    def world_size(self) -> int:
        return getattr(self.inner, "world_size", 1)

    @property
    def device(self) -> Any:
        return getattr(self.inner, "device", None)

    def loglikelihood(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("loglikelihood", requests)

    def loglikelihood_rolling(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("loglikelihood_rolling", requests)

    def generate_until(self, requests: list[Any], **kwargs: Any) -> list[Any]:
        return self._answer("generate_until", requests)

    def _answer(self, request_type: str, requests: list[Any]) -> list[Any]:
        # Keys before the model sees the requests: an adapter may pop keys from gen_kwargs.
        keys = [ResponseCache.key(request_type, tuple(req.args)) for req in requests]
        stored = self.cache.get_many(keys)
        answers: list[Any] = [None] * len(requests)
        pending = []
        for index, key in enumerate(keys):
            if key in stored:
                answers[index] = decode_response(request_type, stored[key])
            else:
                pending.append(index)
        done = len(requests) - len(pending)
        self.cached_count += done
        self._progress(done, len(requests), requests[pending[0]] if pending else None)
        model_method = getattr(self.inner, request_type)
        quiet = {"disable_tqdm": True} if "disable_tqdm" in inspect.signature(model_method).parameters else {}
        # Longest first, so a chunk holds prompts of similar length (scoring batches equal lengths).
        pending.sort(key=lambda i: -len(str(requests[i].args[0])))
        for start in range(0, len(pending), self.chunk_size):
            chunk = pending[start : start + self.chunk_size]
            outputs = model_method([requests[i] for i in chunk], **quiet)
            if len(outputs) != len(chunk):
                raise RuntimeError(
                    f"{type(self.inner).__name__}.{request_type} returned {len(outputs)} answers "
                    f"for {len(chunk)} requests"
                )
            self.cache.put_many(
                [(keys[i], encode_response(request_type, out)) for i, out in zip(chunk, outputs)]
            )
            for i, out in zip(chunk, outputs):
                answers[i] = out
            self.computed_count += len(chunk)
            done += len(chunk)
            self._progress(done, len(requests), requests[chunk[-1]])
        return answers

    def _progress(self, done: int, total: int, request: Any) -> None:
        if self.on_progress is not None:
            self.on_progress(done, total, describe_cell(getattr(request, "doc", None)) if request is not None else "")


# --------------------------------------------------------------------------------------------
# Evaluating one unit


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


def _load_model_default(source: str, device: str, dtype: str | None) -> tuple[Any, Any]:
    from ccq_eval.loading import load_model

    return load_model(source, device=device, dtype=dtype)


def _make_adapter_default(model: Any, tokenizer: Any, max_length: int | None, batch_size: int, seed: int,
                          cuda_graphs: bool) -> Any:
    from ccq_eval.lm_adapter import CCQEvalLM

    kwargs: dict[str, Any] = {"model": model, "tokenizer": tokenizer, "batch_size": batch_size, "seed": seed,
                              "cuda_graphs": cuda_graphs}
    if max_length is not None:
        kwargs["max_length"] = max_length
    return CCQEvalLM(**kwargs)


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


class LmEvalUnitEvaluator:
    """Default unit evaluator: model -> adapter -> ResumableLM -> lm_eval.simple_evaluate.

    Keeps the last loaded model, so consecutive units of one model load it once.
    """

    def __init__(
        self,
        *,
        load_model: Callable[[str, str, str | None], tuple[Any, Any]] = _load_model_default,
        make_adapter: Callable[[Any, Any, int | None, int, int, bool], Any] = _make_adapter_default,
        task_catalog: TaskCatalog | None = None,
    ) -> None:
        self._load_model = load_model
        self._make_adapter = make_adapter
        self._task_catalog = task_catalog
        self._loaded_key: tuple[str, str, str | None] | None = None
        self._loaded: tuple[Any, Any] | None = None

    def _model(self, source: str, device: str, dtype: str | None) -> tuple[Any, Any]:
        key = (source, device, dtype)
        if self._loaded_key != key:
            self._loaded = None  # free the previous model before loading the next
            self._loaded = self._load_model(source, device, dtype)
            self._loaded_key = key
        assert self._loaded is not None
        return self._loaded

    def __call__(self, unit: Unit, context: UnitContext) -> UnitOutcome:
        from lm_eval import evaluator

        options = context.plan.options
        model, tokenizer = self._model(unit.model_source, options.device, options.dtype)
        adapter = self._make_adapter(model, tokenizer, unit.spec["max_length"], options.batch_size, options.seed,
                                     options.cuda_graphs)
        wrapped = ResumableLM(adapter, context.cache, chunk_size=options.batch_size,
                              on_progress=context.on_progress)
        catalog = self._task_catalog or default_task_catalog()
        metadata = dict(unit.spec["task_metadata"])
        metadata.setdefault("tokenizer", unit.model_source)
        task_manager = catalog.make_task_manager(metadata)
        seed = options.seed
        kwargs = {"bootstrap_iters": 1000} | dict(context.plan.lm_eval_args)
        results = evaluator.simple_evaluate(
            model=wrapped,
            tasks=[unit.task],
            task_manager=task_manager,
            limit=options.limit,
            log_samples=True,
            batch_size=options.batch_size,
            device=options.device,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            **kwargs,
        )
        if results is None:
            raise RuntimeError(f"lm-eval returned no results for {unit.task}")
        samples = results.pop("samples", {}) or {}
        if isinstance(results.get("config"), dict):
            results["config"]["model"] = unit.model
        meta = {
            "model_config_sha256": model_config_sha256(model),
            "truncation": truncation_info(adapter),
            "requests_from_cache": wrapped.cached_count,
            "requests_computed": wrapped.computed_count,
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
    """Which kernel paths a CUDA run uses (bf16 results differ slightly between them): the CCQ read,
    the scoring log-softmax, the autotuning cap. Recorded in CUDA runs' metadata (CPU runs use torch
    throughout), read in every run so that a bad setting fails before the first unit."""
    from ccq_eval.ccq import fused_kernel_enabled
    from ccq_eval.token_logprob import selected_implementation

    return {"ccq_read": "fused" if fused_kernel_enabled() else "unfused",
            "token_logprob": selected_implementation(),
            "autotune_configs": os.environ.get("CCQ_EVAL_AUTOTUNE_CONFIGS")}


@dataclass
class RunSummary:
    done: list[Unit] = field(default_factory=list)
    skipped: list[Unit] = field(default_factory=list)
    failed: list[tuple[Unit, str]] = field(default_factory=list)


def default_evaluator() -> EvaluateUnit:
    """The unit evaluator `ccq-eval run` uses (a function, so tests can substitute one)."""
    return LmEvalUnitEvaluator()


def execute_plan(
    plan: RunPlan,
    *,
    evaluate_unit: EvaluateUnit | None = None,
    reporter: Reporter | None = None,
    command_line: Sequence[str] | None = None,
) -> RunSummary:
    """Evaluate every unfinished unit of `plan` and store it; finished units are skipped.

    A failing unit stops the run (or, with keep_going, is reported and the run goes on);
    what was finished or answered before stays on disk either way.
    """
    evaluate = evaluate_unit or default_evaluator()
    report = reporter or SilentReporter()
    argv = list(options_command_line(plan.options) if command_line is None else command_line)
    kernels = gpu_kernel_settings()  # read (and a bad value refused) before any unit runs
    summary = RunSummary(skipped=[unit for unit in plan.units if unit.finished])
    report.run_start(plan)
    try:
        pending = plan.pending
        for index, unit in enumerate(pending):
            report.unit_start(unit, index, len(pending))
            results_store.atomic_write_json(unit.dir.spec, unit.spec)
            cache = ResponseCache(unit.dir.responses_db)
            started = time.time()
            try:
                context = UnitContext(
                    plan=plan,
                    cache=cache,
                    on_progress=lambda done, total, cell, unit=unit: report.requests(unit, done, total, cell),
                )
                outcome = evaluate(unit, context)
            except Exception as exc:
                detail = f"{type(exc).__name__}: {exc}"
                report.unit_end(unit, "failed", detail)
                summary.failed.append((unit, detail))
                if not plan.options.keep_going:
                    raise
                continue
            finally:
                cache.close()
            wall_time = time.time() - started
            meta = {
                "model": unit.model,
                "model_source": unit.model_source,
                "task": unit.task,
                "requested_as": unit.requested_as,
                "spec": unit.spec,
                "seed": plan.options.seed,
                "device": plan.options.device,
                "dtype": plan.options.dtype,
                "batch_size": plan.options.batch_size,
                "wall_time_s": round(wall_time, 3),
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "command_line": shlex.join(argv),
                "argv": list(sys.argv),
                "cwd": os.getcwd(),
                "versions": package_versions(),
                "gpu_kernels": kernels if str(plan.options.device).startswith("cuda") else None,
                "cuda_graphs": plan.options.cuda_graphs,
                "platform": platform.platform(),
            } | outcome.meta
            results_store.write_unit(unit.dir, outcome.results, outcome.samples, meta)
            unit.finished = True
            summary.done.append(unit)
            report.unit_end(unit, "done", f"{wall_time:.1f} s")
    finally:
        report.run_end()
    return summary
