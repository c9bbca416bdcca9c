"""lm-eval's own recall tasks (swde, fda, squad_completion: the `lm-eval` protocol of the recall table) on
local data.

    load_lmeval_tasks(task_manager, names, recall_dir) -> what TaskManager.load returns for `names`

lm-eval 0.4.13 defines these three tasks as Python classes (`class: !function task.SWDE`, ...) whose dataset is
a class attribute (DATASET_PATH, hazyresearch's based-* sets) and whose constructor ignores config overrides,
so the zero-shot suite's way (the config's dataset_path / data_files) does not reach them. Where --recall-dir
holds a task's dataset file, the task is built from lm-eval's own class with only its download replaced: the
rows come from that file (checked first, ccq_eval.tasks.recall.data.read_file); prompts, generation arguments
and the score stay lm-eval's. Without a file, TaskManager.load builds the task as lm-eval does (hub or cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ccq_eval.task_families import RECALL_LMEVAL_TASKS

__all__ = ["RECALL_LMEVAL_TASKS", "load_lmeval_tasks"]


def _local_class(lmeval_class: type, path: Path) -> type:
    """lm-eval's task class with `download` reading `path` as its validation split (json rows)."""

    def download(self: Any, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        import datasets

        self.dataset = datasets.load_dataset("json", data_files={"validation": str(path)})

    return type(lmeval_class.__name__, (lmeval_class,), {"download": download, "__module__": lmeval_class.__module__})


def load_lmeval_tasks(task_manager: Any, names: list[str], recall_dir: str | Path | None) -> dict[str, Any]:
    """TaskManager.load(names), lm-eval's recall tasks built on the --recall-dir file of their dataset where
    `recall_dir` holds one."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from ccq_eval.tasks.recall.data import dataset_for, local_file, read_file

    specs: list[Any] = []
    for name in names:
        path = local_file(dataset_for(name), recall_dir) if name in RECALL_LMEVAL_TASKS else None
        if path is None:
            specs.append(name)
            continue
        read_file(path, dataset_for(name))  # every row, before lm-eval reads any
        entry = task_manager._entry(name)  # also makes ccq's TaskManager index lm-eval's built-in tasks
        lmeval_class = load_yaml(entry.yaml_path, resolve_func=True)["class"]
        task = _local_class(lmeval_class, path)()
        task.config.task = name  # as lm-eval's TaskFactory names a class task
        specs.append(task)
    return task_manager.load(specs)
