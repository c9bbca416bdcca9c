"""`ccq-eval run`'s options parsed and checked in one pass (parse_options), into the one object planning
reads (ParsedOptions): the grid of lengths, depths and samples, --lm-eval-arg pairs (simple_evaluate
arguments and lm-eval's result loggers), --shard, --ccq-attach, --suite and the data folders. A bad value
raises PlanError naming the option and a valid form. Imports neither torch nor lm-eval unless
--lm-eval-arg is given.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError
from ccq_eval.harness.run_options import RunOptions
from ccq_eval.harness.suites import SUITES, Suite
from ccq_eval.harness.zeroshot import ROLLING_PROTOCOLS

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
    "evaluation_tracker": "--output (units are also stored as lm-eval's tracker stores them: <output>/lm_eval)",
    "metadata": "--lengths / --depths / --samples-per-cell",
    "verbosity": "(not a result setting)",
    "predict_only": "(metrics are always computed)",
}


# simple_evaluate arguments the runner cannot honour, when true, with the reason.
UNSUPPORTED_LMEVAL_ARGS = {
    "apply_chat_template": "the ccq adapter has no chat template support: the tasks' prompts go to the model "
                           "as they are (our tasks are written for base LMs); leave it out",
    "fewshot_as_multiturn": "it needs a chat template, which the ccq adapter does not apply; leave it out",
    "check_integrity": "it runs lm-eval's own task tests, which an installed lm-eval does not ship; leave it "
                       "out (`python -m pytest` runs this project's tests)",
}


class PlanError(UserError):
    """A bad command (unknown name, unparseable or conflicting options); nothing was loaded."""


# The default run: small enough for a 2-core CPU in minutes on the embedded tiny models.
DEFAULT_LENGTHS = "1k,2k"
DEFAULT_DEPTHS = "0,50,100"
DEFAULT_SAMPLES_PER_CELL = 4
DTYPE_CHOICES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")


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
    labels: dict[str, float] = {}
    for value in depths:  # the tables show a depth to two decimals: two depths must not read the same
        label = f"{value:.2f}"
        if label in labels:
            raise PlanError(f"--depths: {labels[label]!r} and {value!r} both read {label} in the tables; give depths "
                            "that differ within two decimals")
        labels[label] = value
    return sorted(depths)


# lm-eval's result loggers (its CLI's --wandb_args / --wandb_config_args): applied to each unit's
# results after simple_evaluate, and not part of what a unit computes.
LOGGER_ARGS = ("wandb_args", "wandb_config_args")


def split_logger_args(pairs: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """--lm-eval-arg values -> (simple_evaluate pairs, {logger argument: its key=value,... as a dict}),
    e.g. `wandb_args=project=ccq,name=run1` -> {"wandb_args": {"project": "ccq", "name": "run1"}}."""
    rest, loggers = [], {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key.strip() in LOGGER_ARGS:
            from lm_eval.utils import simple_parse_args_string

            loggers[key.strip()] = simple_parse_args_string(value)
        else:
            rest.append(pair)
    if loggers and "wandb_args" not in loggers:
        raise PlanError("--lm-eval-arg wandb_config_args needs wandb_args too (W&B's init arguments)")
    if loggers and importlib.util.find_spec("wandb") is None:
        raise PlanError("--lm-eval-arg wandb_args: W&B logging needs the wandb package (pip install wandb)")
    return rest, loggers


def parse_lm_eval_args(pairs: Sequence[str]) -> dict[str, Any]:
    """['bootstrap_iters=1000', ...] -> {'bootstrap_iters': 1000}; keys checked against simple_evaluate,
    values typed as lm-eval types its own key=value arguments (lm_eval.utils.handle_arg_string)."""
    if not pairs:
        return {}
    from lm_eval.utils import handle_arg_string

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
        parsed[key] = handle_arg_string(value)
        if key in UNSUPPORTED_LMEVAL_ARGS and parsed[key]:
            raise PlanError(f"--lm-eval-arg {key}={value}: {UNSUPPORTED_LMEVAL_ARGS[key]}")
    return parsed


def _simple_evaluate_parameters() -> set[str] | None:
    try:
        from lm_eval import evaluator
    except ImportError:  # pragma: no cover - lm-eval is a dependency
        return None
    return set(inspect.signature(evaluator.simple_evaluate).parameters)


def parse_shard(text: str) -> tuple[int, int]:
    """'2/3' -> (2, 3): the second of three parts (K counts from 1, as a Slurm array 1-N)."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise PlanError(f"--shard {text!r}: give K/N with 1 <= K <= N, e.g. --shard 2/3 for the second of three "
                        "workers (Slurm: --shard $SLURM_ARRAY_TASK_ID/N with --array=1-N)")
    return int(match[1]), int(match[2])


# --ccq-attach: training-free CCQ on plain checkpoints, one model per lambda.
@dataclass(frozen=True)
class CCQAttach:
    """A parsed --ccq-attach: the lambdas to sweep and the fixed CCQ config fields (full ccq_* names,
    not yet checked against the config class: `ccq_eval.model.loading.ccq_attach_config` does that)."""

    lambdas: tuple[float, ...]
    fields: dict[str, Any]

    def sweep_name(self, model: str) -> str:
        """'tiny-gla+ccq' plus the fixed fields ('tiny-gla+ccq-order2-formresolvent'): the name the
        sweep's figure and its models carry."""
        fixed = "".join(f"-{key.removeprefix('ccq_')}{_field_text(value)}"
                        for key, value in sorted(self.fields.items()))
        return f"{model}+ccq{fixed}"

    def model_name(self, model: str, lam: float) -> str:
        """The evaluated model of one setting, e.g. 'tiny-gla+ccq-lambda2' (its results folder too)."""
        return f"{self.sweep_name(model)}-lambda{_field_text(lam)}"


def _field_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


_ATTACH_EXAMPLE = 'e.g. --ccq-attach "lambda=0,0.5,1,2,4;order=2"'


def _attach_value(text: str) -> Any:
    """'2' -> 2, '0.5' -> 0.5, 'true' -> True, anything else the text (the config class checks it)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def check_ccq_lambda(value: float, given: str, example: str) -> float:
    """A constant CCQ lambda as --ccq-attach and `inspect --baseline-lambda` take it: a finite number >= 0
    (-0.0 becomes 0.0); `given` names the option and value in the error, `example` shows a valid one."""
    if not math.isfinite(value) or value < 0:
        raise PlanError(f"{given} must be a finite number >= 0 (0 is the plain model); e.g. {example}")
    return value + 0.0


def parse_ccq_attach(text: str) -> CCQAttach:
    """'lambda=0,0.5,1;order=2;form=resolvent' -> CCQAttach((0.0, 0.5, 1.0), {'ccq_order': 2, 'ccq_form':
    'resolvent'}). Items separated by ';'; lambda (required) takes a comma-separated list of numbers >= 0,
    every other key one value; a key is a CCQ config field with or without its 'ccq_' prefix."""
    lambdas: tuple[float, ...] | None = None
    fields: dict[str, Any] = {}
    for item in [part.strip() for part in text.split(";") if part.strip()]:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise PlanError(f"--ccq-attach: {item!r} is not key=value; {_ATTACH_EXAMPLE}")
        if key.lower() in ("lambda", "ccq_lambda"):
            if lambdas is not None:
                raise PlanError("--ccq-attach: lambda is given twice; list every value in one lambda=... item")
            lambdas = _parse_lambdas(value)
            continue
        name = key if key.startswith("ccq_") else f"ccq_{key}"
        if name in fields:
            raise PlanError(f"--ccq-attach: {key} is given twice; give it once")
        if "," in value:
            raise PlanError(f"--ccq-attach: {key}={value}: only lambda takes a list; give {key} one value (run "
                            "another sweep for another value)")
        fields[name] = _attach_value(value)
    if lambdas is None:
        raise PlanError(f"--ccq-attach {text!r} has no lambda values; {_ATTACH_EXAMPLE}")
    return CCQAttach(lambdas, fields)


def _parse_lambdas(text: str) -> tuple[float, ...]:
    values = []
    for token in [t.strip() for t in text.split(",")]:
        try:
            value = float(token)
        except ValueError:
            raise PlanError(f"--ccq-attach: lambda {token!r} is not a number; give comma-separated numbers >= 0 "
                            "such as lambda=0,0.5,1,2,4") from None
        values.append(check_ccq_lambda(value, f"--ccq-attach: lambda {token!r}", "lambda=0,0.5,1,2,4"))
    if len(set(values)) != len(values):
        raise PlanError(f"--ccq-attach: lambda={text} repeats a value; give each once")
    return tuple(sorted(values))


# --------------------------------------------------------------------------------------------
# The launch environment (torchrun / accelerate launch)


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


def workers_override() -> int | None:
    """The processes CCQ_EVAL_WORKERS sets for `--workers auto` (tests set it to 1: fakes and counts stay in one
    process); None when unset."""
    text = os.environ.get("CCQ_EVAL_WORKERS", "").strip()
    if text and not (text.isdigit() and int(text) >= 1):
        raise PlanError(f"environment variable CCQ_EVAL_WORKERS={text!r} is not a whole number >= 1: it sets the "
                        "processes of --workers auto; give one, or unset it (`unset CCQ_EVAL_WORKERS`)")
    return int(text) if text else None


def data_parallel_ranks() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) of this process, (0, 1) outside torchrun / accelerate launch. A RANK that is not
    below WORLD_SIZE (a RANK=1 left in the shell, without the launcher's WORLD_SIZE) is a PlanError:
    that process would evaluate and never write a result. LOCAL_RANK, read once the unit runs, is checked
    here too."""
    rank, world_size = environment_int("RANK", 0), environment_int("WORLD_SIZE", 1)
    environment_int("LOCAL_RANK", 0)  # read by the adapter and lm_eval_call after the model loads
    if world_size < 1 or rank >= world_size:
        raise PlanError(f"environment variables RANK={rank} and WORLD_SIZE={world_size}: the rank must lie "
                        "below the world size; a RANK or WORLD_SIZE left from another launch? unset both "
                        "(`unset RANK WORLD_SIZE`) or start the run with torchrun / accelerate launch")
    missing = [name for name in _LAUNCHER_VARIABLES if not os.environ.get(name, "").strip()]
    if world_size > 1 and missing:  # the process would wait for ranks that never come
        raise PlanError(f"environment variable WORLD_SIZE={world_size} asks for a data-parallel run, but "
                        f"{', '.join(missing)} (which torchrun and accelerate launch set) is not set: a WORLD_SIZE "
                        "left from another launch? unset it (`unset RANK WORLD_SIZE`) or start the run with "
                        "torchrun / accelerate launch")
    return rank, world_size


# What torchrun (and accelerate launch, which runs it) sets beside RANK and WORLD_SIZE, per process; a
# shell that kept RANK / WORLD_SIZE from an earlier launch rarely keeps it too (MASTER_ADDR / MASTER_PORT,
# when missing, are refused by torch itself at once).
_LAUNCHER_VARIABLES = ("LOCAL_RANK",)


# --------------------------------------------------------------------------------------------
# All options in one pass


@dataclass(frozen=True)
class Grid:
    """The lengths, depths and sample counts a run asks its tasks for, defaults filled in."""

    using_defaults: bool  # no --task and no --suite: the default tasks' small grid
    lengths: list[int] | None
    depths: list[float] | None
    samples_per_cell: int | None
    max_length: int | None  # --max-length, else the longest length


@dataclass(frozen=True)
class ParsedOptions:
    """RunOptions parsed and checked: everything planning reads of the command line."""

    options: RunOptions  # as given (a unit's meta.json records the command that reproduces them)
    grid: Grid
    lm_eval_args: dict[str, Any]  # simple_evaluate arguments (parse_lm_eval_args)
    lm_eval_loggers: dict[str, dict[str, Any]]  # lm-eval's result loggers (split_logger_args)
    shard: tuple[int, int] | None  # (K, N) of --shard K/N
    attach: CCQAttach | None  # --ccq-attach
    suite: Suite | None  # --suite
    longbench_dir: Path | None  # --longbench-dir, an existing folder
    qa_dir: Path | None  # --qa-dir, an existing folder (absolute)
    zeroshot_dir: Path | None  # --zeroshot-dir, an existing folder (absolute)
    recall_dir: Path | None = None  # --recall-dir, an existing folder (absolute)


def parse_options(options: RunOptions) -> ParsedOptions:
    """Every option of `options` parsed and checked against the others, in one pass; raises PlanError.
    Reads no registry, task or model: planning resolves those names afterwards."""
    _check_values(options)
    evaluate_pairs, lm_eval_loggers = split_logger_args(options.lm_eval_args)
    lm_eval_args = parse_lm_eval_args(evaluate_pairs)
    for flag, text in (("--lengths", options.lengths), ("--depths", options.depths)):
        if text is not None and not text.strip(" ,"):
            raise PlanError(f"{flag} is empty; give comma-separated values (e.g. --lengths 1k,2k --depths 0,50,100) "
                            "or leave the option out for the defaults")
    shard = parse_shard(options.shard) if options.shard is not None else None
    attach = parse_ccq_attach(options.ccq_attach) if options.ccq_attach is not None else None
    if attach is not None and not options.models:
        raise PlanError("--ccq-attach needs --model: name the plain checkpoints (GLA, Gated DeltaNet, DeltaNet, KDA, "
                        "RetNet, Mamba2 or Preconditioned Gated DeltaNet) to attach "
                        "CCQ to (e.g. --model tiny-gla)")
    output = Path(options.output)
    for folder in (output, *output.parents):
        if folder.exists() and not folder.is_dir():
            raise PlanError(f"--output {options.output}: {folder} is a file, not a folder; give a folder path")
    return ParsedOptions(
        options=options, grid=_grid(options), lm_eval_args=lm_eval_args, lm_eval_loggers=lm_eval_loggers,
        shard=shard, attach=attach, suite=SUITES[options.suite] if options.suite is not None else None,
        longbench_dir=Path(options.longbench_dir) if options.longbench_dir is not None else None,
        qa_dir=Path(options.qa_dir).resolve() if options.qa_dir is not None else None,
        zeroshot_dir=Path(options.zeroshot_dir).resolve() if options.zeroshot_dir is not None else None,
        recall_dir=Path(options.recall_dir).resolve() if options.recall_dir is not None else None,
    )


DEVICE_FORM = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_device_form(requested: str) -> None:
    """A PlanError unless --device is auto, cpu, mps, cuda or cuda:N (whether the machine has it is
    planning's question, plan.resolve_device)."""
    if not DEVICE_FORM.match(str(requested)):
        raise PlanError(f"--device {requested!r} is not a device; give auto, cpu, cuda or cuda:N (mps on a "
                        "Mac)")


def _check_values(options: RunOptions) -> None:
    """The options that are wrong on their own or together, before any name is resolved."""
    check_device_form(options.device)
    if options.limit is not None and options.samples_per_cell is not None:
        raise PlanError(
            "--limit and --samples-per-cell conflict: --limit takes the first N documents of a task "
            "across all lengths, --samples-per-cell sets N per (length, depth) cell; give one of them"
        )
    _check_limit(options.limit)
    for flag, value, wanted in (("--samples-per-cell", options.samples_per_cell, "a positive whole number"),
                                ("--batch-size", options.batch_size, "a positive whole number"),
                                ("--max-length", options.max_length, "a positive number of tokens")):
        if value is not None and value <= 0:
            raise PlanError(f"{flag} must be {wanted}")
    if not 0 <= options.seed < 2**32:
        raise PlanError(f"--seed {options.seed} is out of range: give a whole number from 0 to {2**32 - 1} "
                        "(numpy's seed range, which lm-eval seeds too)")
    data_parallel_ranks()
    workers_override()
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
    for flag, folder in (("--longbench-dir", options.longbench_dir), ("--qa-dir", options.qa_dir),
                         ("--zeroshot-dir", options.zeroshot_dir), ("--recall-dir", options.recall_dir)):
        if folder is not None and not Path(folder).is_dir():
            raise PlanError(f"{flag} {folder}: no such folder")
    if options.rolling_windows is not None and options.rolling_windows not in ROLLING_PROTOCOLS:
        raise PlanError(f"--rolling-windows {options.rolling_windows!r}: valid choices are "
                        f"{', '.join(ROLLING_PROTOCOLS)} (hflm: lm-eval HFLM's windows, the papers' protocol; "
                        "carry: one recurrent pass over each text)")
    _check_recall_values(options)


def _check_limit(limit: float | None) -> None:
    """--limit as lm-eval takes it: a count of documents (a whole number >= 1) or a fraction in (0, 1). NaN,
    infinity or 2.5 would reach lm-eval only after the model loaded (int(nan) fails there; 2.5 means 2)."""
    if limit is None:
        return
    if not math.isfinite(limit) or limit <= 0 or (limit >= 1 and not float(limit).is_integer()):
        raise PlanError(f"--limit {limit}: give a whole number of documents (e.g. --limit 100) or a fraction "
                        "of each task's documents below 1 (e.g. --limit 0.1)")


RECALL_PROTOCOLS = ("jrt", "lm-eval")
RECALL_PROMPTS = ("once", "twice")
RECALL_ANSWER_TOKENS = 48  # tasks/recall/jrt.py's ANSWER_LENGTH: a length must leave room beyond it


def _check_recall_values(options: RunOptions) -> None:
    """--recall-protocol, --recall-length and --recall-prompt on their own and together."""
    protocol = options.recall_protocol
    if protocol is not None and protocol not in RECALL_PROTOCOLS:
        raise PlanError(f"--recall-protocol {protocol!r}: valid choices are {', '.join(RECALL_PROTOCOLS)} (jrt: "
                        "the JRT harness's cut and prompts, the papers' table; lm-eval: lm-eval's swde, fda, "
                        "squad_completion)")
    if options.recall_prompt is not None and options.recall_prompt not in RECALL_PROMPTS:
        raise PlanError(f"--recall-prompt {options.recall_prompt!r}: valid choices are {', '.join(RECALL_PROMPTS)}")
    if options.recall_length is not None and options.recall_length <= RECALL_ANSWER_TOKENS:
        raise PlanError(f"--recall-length {options.recall_length}: the cut keeps that many tokens less the "
                        f"{RECALL_ANSWER_TOKENS} left for the answer; give more than {RECALL_ANSWER_TOKENS} "
                        "(the papers: 2048)")
    if protocol == "lm-eval":
        given = [flag for flag, value in (("--recall-length", options.recall_length),
                                          ("--recall-prompt", options.recall_prompt)) if value is not None]
        if given:
            raise PlanError(f"{', '.join(given)} set the jrt protocol's cut and prompt; lm-eval's swde, fda and "
                            "squad_completion neither cut nor repeat the document: drop them, or use "
                            "--recall-protocol jrt")


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
