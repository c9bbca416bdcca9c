"""Task names: aliases, our lm-eval tasks, lm-eval's own tasks, and the error for unknown names."""

from __future__ import annotations

import pytest

from ccq_eval.harness import task_registry
from ccq_eval.harness.task_registry import UnknownTaskError, list_tasks, make_task_manager, resolve_tasks


def test_aliases_resolve_to_our_leaf_tasks() -> None:
    assert resolve_tasks(["s-niah-2"]) == ["ccq_s_niah_2"]
    assert resolve_tasks("ppl,ppl-sweep") == ["ccq_ppl_buckets", "ccq_ppl_sweep"]
    assert resolve_tasks(["ccq_ppl"]) == ["ccq_ppl_buckets", "ccq_ppl_sweep"]  # the tag
    longbench = resolve_tasks(["longbench"])
    assert longbench[0] == "ccq_longbench_narrativeqa" and all(t.startswith("ccq_longbench_") for t in longbench)
    assert resolve_tasks(["longbench"], expand_groups=False) == ["ccq_longbench"]
    names = list_tasks()
    assert {"s-niah", "s-niah-1", "ppl", "longbench", "longbench-e", "ccq_ppl_sweep"} <= set(names)


def test_unknown_names_list_the_valid_ones(monkeypatch) -> None:
    with pytest.raises(UnknownTaskError) as info:
        resolve_tasks(["ccq_s_niah_9"])  # ccq_ names are ours only: no need to index lm-eval's
    message = str(info.value)
    assert "ccq_s_niah_9" in message and "s-niah" in message and "longbench-e" in message
    assert isinstance(info.value, KeyError)

    # other names are looked up in lm-eval's own index (replaced here: building it takes ~10 s); the zero-shot
    # suite's names (lambada_openai) in the index of the suite's folders alone
    monkeypatch.setattr(task_registry, "_default_index", lambda: {"mmlu": object()})
    assert resolve_tasks(["lambada_openai", "mmlu", "ppl-sweep"]) == ["lambada_openai", "mmlu", "ccq_ppl_sweep"]
    with pytest.raises(KeyError, match="valid names: ruler, ruler-synthetic, niah, s-niah"):
        resolve_tasks(["s-niha"])


def test_task_manager_indexes_only_our_folders_until_asked() -> None:
    manager = make_task_manager({"tokenizer": "byt5"})
    assert "ccq_ppl_buckets" in manager.all_tasks and "ccq_s_niah" in manager.all_groups
    assert "lambada_openai" not in manager.all_tasks
