"""Drift guard: the lm-eval internals ccq-eval's task manager relies on (lm-eval 0.4.13).

task_registry.CCQTaskManager subclasses lm-eval's TaskManager: it looks names up through `_entry` (which
lm-eval's own loading calls), adds lm-eval's built-in index lazily by merging into `_index` and refreshing
the `_all_*` name lists, and builds indexes with `TaskIndex.build`; zeroshot.task_config reads a config with
`_yaml_loader.load_yaml`. None of this is lm-eval's public API, so a new lm-eval that moves it must fail here,
by name, rather than somewhere in a run.
"""

from __future__ import annotations

import inspect

from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import Kind, TaskIndex
from lm_eval.tasks._yaml_loader import load_yaml

from ccq_eval.harness.task_registry import make_task_manager


def test_task_manager_looks_names_up_through_entry_and_keeps_the_lists_we_refresh():
    assert list(inspect.signature(TaskManager._entry).parameters) == ["self", "name"]
    assert "self._entry(" in inspect.getsource(TaskManager)  # lm-eval's loading reaches our override
    manager = make_task_manager()
    assert isinstance(manager._index, dict) and "ccq_s_niah_1" in manager._index
    source = inspect.getsource(TaskManager)
    for name in ("_all_tasks", "_all_subtasks", "_all_groups", "_all_tags"):
        assert isinstance(getattr(manager, name), list) and f"self.{name}" in source, name


def test_index_building_and_yaml_loading_keep_their_signatures():
    assert {"TASK", "PY_TASK", "GROUP", "TAG"} <= {kind.name for kind in Kind}
    assert callable(TaskIndex.build)
    assert "resolve_func" in inspect.signature(load_yaml).parameters
    entry = make_task_manager()._entry("ccq_s_niah_1")
    assert entry.kind in (Kind.TASK, Kind.PY_TASK) and entry.yaml_path is not None
    assert load_yaml(entry.yaml_path, resolve_func=False)["task"] == "ccq_s_niah_1"
