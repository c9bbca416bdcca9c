"""Parsing `ccq-eval run`'s options: lengths, depths, --lm-eval-arg pairs (simple_evaluate arguments and
lm-eval's result loggers) and --shard. A bad value raises PlanError naming the option and a valid form.
Imports neither torch nor lm-eval unless --lm-eval-arg is given.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from collections.abc import Sequence
from typing import Any

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


class PlanError(Exception):
    """A bad command (unknown name, unparseable or conflicting options); nothing was loaded."""


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
