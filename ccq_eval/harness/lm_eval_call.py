"""One unit's evaluation through lm-eval's evaluator (lm_eval.evaluator.evaluate), with what
lm_eval.simple_evaluate adds around that call for an LM object that is already built (lm-eval 0.4.13,
lm_eval/evaluator.py): the seeds, loading the tasks and applying gen_kwargs / num_fewshot to them, and the
results' config, git, environment and tokenizer entries.

simple_evaluate itself runs `git describe` with stderr left open, which prints git's "not a git
repository" once per unit when a run starts outside a git checkout; here the same lookup runs with its
stderr captured. Every simple_evaluate argument that `run --lm-eval-arg` may set (options.py) is a
keyword of evaluate_tasks, so lm-eval is called through its public functions only.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from ccq_eval.harness.options import environment_int
from ccq_eval.harness.recall import RECALL_LMEVAL_TASKS, load_lmeval_tasks
from ccq_eval.harness.zeroshot import ZEROSHOT_TASKS, load_tasks

logger = logging.getLogger(__name__)


def git_commit_hash() -> str | None:
    """The results' git_hash as lm-eval's get_git_commit_hash finds it (`git describe --always` in the
    working folder, else the commit a .git folder there names), git's messages captured."""
    try:
        return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        from lm_eval.loggers.utils import get_commit_from_path

        return get_commit_from_path(os.getcwd())


# lm-eval's add_env_info entries that do not change within a process (torch's environment report, the
# transformers and lm-eval versions), taken once: torch's report runs pip, nvidia-smi, lscpu and more in
# subprocesses (about 2 s a call), which every unit of a run would otherwise repeat.
_PROCESS_ENVIRONMENT: dict[str, Any] = {}


def add_environment_info(results: dict[str, Any]) -> None:
    """lm_eval's add_env_info(results): the process's environment entries (taken once per process), and the
    git commit of the folder above the working folder (looked up each time: the working folder may change)."""
    from lm_eval.loggers.utils import add_env_info, get_commit_from_path

    if not _PROCESS_ENVIRONMENT:
        add_env_info(_PROCESS_ENVIRONMENT)
    results.update(_PROCESS_ENVIRONMENT)
    results["upper_git_hash"] = get_commit_from_path(Path(os.getcwd(), ".."))


def _load(task_manager: Any, tasks: list[str], zeroshot_dir: str | None) -> dict[str, Any]:
    """TaskManager.load(tasks); the zero-shot suite's tasks through zeroshot.load_tasks (data from
    `zeroshot_dir` where it holds them, a dataset no source holds as one line), lm-eval's recall tasks through
    recall.load_lmeval_tasks (data from the manager's recall_dir metadata where it holds them)."""
    if any(task in ZEROSHOT_TASKS for task in tasks):
        return load_tasks(task_manager, tasks, zeroshot_dir)
    if any(task in RECALL_LMEVAL_TASKS for task in tasks):  # lm-eval's recall tasks on --recall-dir's files
        return load_lmeval_tasks(task_manager, tasks, (getattr(task_manager, "metadata", None) or {}).get("recall_dir"))
    return task_manager.load(tasks)


def _apply_overrides(loaded: dict[str, Any], gen_kwargs: dict[str, Any] | None, num_fewshot: int | None,
                     seed: int) -> None:
    """gen_kwargs, num_fewshot and the few-shot seed set on each loaded task, as simple_evaluate sets them."""
    for task_name, task in loaded["tasks"].items():
        if task.get_config("output_type") == "generate_until" and gen_kwargs is not None:
            task.set_config(key="generation_kwargs", value=gen_kwargs, update=True)
        if num_fewshot is None:
            if task.get_config("num_fewshot") is None:  # a task without a default is zero-shot
                task.set_config(key="num_fewshot", value=0)
        elif (default := task.get_config("num_fewshot")) == 0:
            logger.info("num_fewshot has been set to 0 for %s in its config. Manual configuration will be "
                        "ignored.", task_name)
        else:
            logger.warning("Overwriting default num_fewshot of %s from %s to %s", task_name, default, num_fewshot)
            task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=seed)


def _parsed_gen_kwargs(gen_kwargs: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """gen_kwargs as simple_evaluate reads it: a "key=value,..." string parsed into a dict, with lm-eval's
    warning that it overrides the tasks' own generation settings; an empty value is kept as it is."""
    if not gen_kwargs:
        return gen_kwargs
    if isinstance(gen_kwargs, str):
        from lm_eval.utils import simple_parse_args_string

        gen_kwargs = simple_parse_args_string(gen_kwargs)
    logger.warning("generation_kwargs: %s specified through cli, these settings will update set parameters "
                   "in yaml tasks. Ensure 'do_sample=True' for non-greedy decoding!", gen_kwargs)
    return gen_kwargs or None


def evaluate_tasks(
    lm: Any,
    task_manager: Any,
    tasks: list[str],
    *,
    model_name: str,
    limit: float | None,
    batch_size: int | str | None,
    device: str | None,
    seed: int,
    bootstrap_iters: int = 100000,
    num_fewshot: int | None = None,
    gen_kwargs: str | dict[str, Any] | None = None,
    cache_requests: bool = False,
    rewrite_requests_cache: bool = False,
    delete_requests_cache: bool = False,
    write_out: bool = False,
    system_instruction: str | None = None,
    apply_chat_template: bool | str = False,
    fewshot_as_multiturn: bool = True,
    check_integrity: bool = False,
    confirm_run_unsafe_code: bool = False,
    zeroshot_dir: str | None = None,
) -> dict[str, Any] | None:
    """lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, log_samples=True, every seed
    = seed, ...) for an LM object: the results dict (None on a data-parallel rank other than 0), its config
    naming the model `model_name`. The zero-shot suite's tasks are loaded through zeroshot.load_tasks (their
    data from `zeroshot_dir` where it holds them, a missing dataset as one line)."""
    import numpy as np
    from lm_eval.evaluator import evaluate
    from lm_eval.loggers.utils import add_tokenizer_info
    from lm_eval.utils import set_torch_seed

    if check_integrity:  # refused when planning (options.UNSUPPORTED_LMEVAL_ARGS): no task tests installed
        raise ValueError("check_integrity runs lm-eval's own task tests, which an installed lm-eval does not ship")
    start_date = time.time()
    if delete_requests_cache:
        from lm_eval.caching.cache import delete_cache

        delete_cache()
    random.seed(seed)
    np.random.seed(seed)
    set_torch_seed(seed)
    gen_kwargs = _parsed_gen_kwargs(gen_kwargs)
    loaded = _load(task_manager, tasks, zeroshot_dir)
    _apply_overrides(loaded, gen_kwargs if isinstance(gen_kwargs, dict) else None, num_fewshot, seed)
    # lm-eval prints "bootstrapping for stddev: <metric>" (lm_eval/api/metrics.py): to the debug log, except
    # where write_out asks for lm-eval's printed prompts.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed) if not write_out else contextlib.nullcontext():
        results = evaluate(lm=lm, task_dict=loaded, limit=limit, cache_requests=cache_requests,
                           rewrite_requests_cache=rewrite_requests_cache, bootstrap_iters=bootstrap_iters,
                           write_out=write_out, log_samples=True, system_instruction=system_instruction,
                           apply_chat_template=apply_chat_template, fewshot_as_multiturn=fewshot_as_multiturn,
                           confirm_run_unsafe_code=confirm_run_unsafe_code)
    for line in printed.getvalue().splitlines():
        logger.debug("lm-eval: %s", line)
    if lm.rank != 0 or environment_int("LOCAL_RANK", 0) != 0:
        return None
    results["config"] = {
        "model": model_name, "model_args": None, **(lm.get_model_info() if hasattr(lm, "get_model_info") else {}),
        "batch_size": batch_size, "batch_sizes": list(lm.batch_sizes.values()) if hasattr(lm, "batch_sizes") else [],
        "device": device, "use_cache": None, "limit": limit, "bootstrap_iters": bootstrap_iters,
        "gen_kwargs": gen_kwargs, "random_seed": seed, "numpy_seed": seed, "torch_seed": seed,
        "fewshot_seed": seed,
    }
    results["git_hash"] = git_commit_hash()
    results["date"] = start_date
    add_environment_info(results)
    add_tokenizer_info(results, lm)
    return results
