"""The task-family table against every task our folders define: a task, group or tag of ours that no
family claims, or a family whose request type or metrics differ from its tasks' configs, fails here."""

from __future__ import annotations

import re

import pytest

from ccq_eval.task_families import FAMILIES, OTHER, UnknownTaskFamilyError, family_of


def _leaf_configs() -> dict[str, dict]:
    """Our leaf tasks' configs (includes resolved), by task name."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    from ccq_eval.harness import task_registry

    index = task_registry._our_index()
    return {
        name: entry.cfg or load_yaml(entry.yaml_path, resolve_func=False)
        for name, entry in index.items()
        if entry.kind in (Kind.TASK, Kind.PY_TASK)
    }


def test_every_task_group_and_tag_of_ours_has_a_family():
    from ccq_eval.harness import task_registry

    folders = {path.parent.name for path in task_registry.tasks_dir().glob("*/*.yaml")}
    assert folders == set(task_registry.TASK_FOLDERS), "a task folder the registry does not include"
    names = task_registry.our_task_names()
    assert names, "no task of ours found"
    unclaimed = [name for name in names if family_of(name) is OTHER]
    assert not unclaimed, f"tasks of ours without a family in ccq_eval/task_families.py: {unclaimed}"
    for alias, (targets, _) in task_registry.ALIASES.items():
        assert all(family_of(target) is not OTHER for target in targets), alias


def test_every_family_of_ours_has_tasks_and_matches_their_configs():
    configs = _leaf_configs()
    for family in FAMILIES:
        tasks = [name for name in configs if family_of(name) is family]
        if family is OTHER:
            assert not tasks
            continue
        if family.task_names:  # lm-eval's own tasks (tests/harness/test_zeroshot_suite.py checks their configs)
            continue
        assert tasks, f"family {family.name} claims no task of ours"
        for task in tasks:
            config = configs[task]
            assert config.get("output_type") == family.request_type, task
            # acc_1024, score_0-4k, ppl@4096: per-length / per-bucket variants of a base metric
            declared = {re.split(r"[@_](?=\d)", str(m["metric"]))[0] for m in config.get("metric_list") or []}
            assert declared <= set(family.metrics), (task, declared - set(family.metrics))
        assert family.primary_metric in family.metrics


def test_family_tables_name_pivots_the_tables_module_draws():
    from ccq_eval.analysis import tables

    for family in FAMILIES:
        assert family.tables, family.name
        for table in family.tables:
            assert table.pivot in tables.PIVOTS, (family.name, table.pivot)


@pytest.mark.parametrize(
    ("task", "family"),
    [
        ("ccq_s_niah_2", "s-niah"),
        ("ccq_ppl_buckets", "ppl"),
        ("ccq_ppl", "ppl"),
        ("ccq_longbench_qasper", "longbench"),
        ("ccq_longbench_e_qasper", "longbench-e"),
        ("ccq_longbench_e", "longbench-e"),
        # other harnesses' names are never guessed from substrings ("applied_science" holds "ppl")
        ("hellaswag", "zeroshot"),  # lm-eval's own task, claimed by exact name
        ("hellaswag_de", "other"),
        ("kmmlu_applied_science", "other"),
        ("longbench_qasper", "other"),
    ],
)
def test_family_of_recognises_ours_by_prefix_only(task, family):
    assert family_of(task).name == family


def test_a_task_of_ours_without_a_family_is_a_clear_error():
    with pytest.raises(UnknownTaskFamilyError, match=r"'ccq_new_thing'.*task_families\.py"):
        family_of("ccq_new_thing")


def test_the_table_imports_nothing_heavy():
    import subprocess
    import sys

    code = (
        "import sys, ccq_eval.task_families; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pandas', 'lm_eval')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("task", "shown"),
    [
        ("ccq_s_niah_1", "S-NIAH-1"),
        ("ccq_longbench_e_qasper", "LongBench-E qasper"),
        ("ccq_longbench_qasper", "LongBench qasper"),
        ("ccq_ppl_sweep", "ppl_sweep"),
        ("hellaswag", "hellaswag"),
    ],
)
def test_tables_show_tasks_by_their_family_label(task, shown):
    from ccq_eval.analysis import tables

    assert tables.display_task(task) == shown
