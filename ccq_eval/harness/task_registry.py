"""Our lm-eval tasks (ccq_eval.tasks: s_niah, ppl, longbench; tasks/ in the repository) and the names
users type.

    make_task_manager(metadata={...})     -> TaskManager over our folders; lm-eval's built-in
                                             tasks are indexed only when a name needs them
    resolve_tasks(["s-niah", "ppl"])      -> ["ccq_s_niah_1", ..., "ccq_ppl_buckets", ...]
    list_tasks()                          -> {user-facing name: one-line description}

User aliases: s-niah (all three), s-niah-1/2/3, ppl (both protocols), ppl-buckets, ppl-sweep,
longbench, longbench-e, the RULER ones (ALIASES); our lm-eval names (ccq_...) and any lm-eval task name
work too, but for those of lm-eval's RULER port (LMEVAL_RULER_PORT), which stop with a line naming ours.
`run --task` and `inspect --task` both resolve names here.
Groups of ours resolve to their leaf tasks, so a run can store and resume them one by one.
"""

from __future__ import annotations

import difflib
import importlib.resources
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from ccq_eval.errors import UserError
from ccq_eval.task_families import RECALL_LMEVAL_TASKS, RECALL_PAPER_COLUMNS, ZEROSHOT_TASKS

TASKS_PACKAGE = "ccq_eval.tasks"  # tasks/ of the repository, installed as this package (pyproject.toml)
TASK_FOLDERS = ("s_niah", "ruler_niah", "ruler_vt", "ruler_aggregation", "ruler_qa", "ppl", "longbench", "recall")

S_NIAH_TASKS = ("ccq_s_niah_1", "ccq_s_niah_2", "ccq_s_niah_3")
NIAH_TASKS = (*S_NIAH_TASKS, "ccq_niah_multikey_1", "ccq_niah_multikey_2", "ccq_niah_multikey_3",
              "ccq_niah_multivalue", "ccq_niah_multiquery")
# RULER's 13 tasks in its own order (fla's README: niah_single_1..3, niah_multikey_1..3, niah_multiquery,
# niah_multivalue, ruler_vt, ruler_cwe, ruler_fwe, ruler_qa_squad, ruler_qa_hotpot)
RULER_SYNTHETIC_TASKS = (*NIAH_TASKS, "ccq_ruler_vt", "ccq_ruler_cwe", "ccq_ruler_fwe")
RULER_QA_TASKS = ("ccq_ruler_qa_squad", "ccq_ruler_qa_hotpot")
RULER_TASKS = (*RULER_SYNTHETIC_TASKS, *RULER_QA_TASKS)
# The recall table in the papers' column order (SWDE, SQuAD, FDA, TriviaQA, NQ, DROP).
RECALL_TASKS = tuple(task for task, _, _ in RECALL_PAPER_COLUMNS)

# alias -> (targets in our index, description)
ALIASES: dict[str, tuple[tuple[str, ...], str]] = {
    "ruler": (RULER_TASKS, "RULER's 13 tasks: the 8 NIAH tasks, variable tracking, common / frequent words, QA"),
    "ruler-synthetic": (RULER_SYNTHETIC_TASKS, "RULER's 11 synthetic tasks (all but QA; no data needed)"),
    "niah": (NIAH_TASKS, "RULER's 8 needle-in-a-haystack tasks: single, multi-key, multi-value, multi-query"),
    "s-niah": (S_NIAH_TASKS, "RULER single needle-in-a-haystack, all three variants"),
    "s-niah-1": (("ccq_s_niah_1",), "S-NIAH-1: passkey (7-digit number) in repeated noise"),
    "s-niah-2": (("ccq_s_niah_2",), "S-NIAH-2: 7-digit number in essays"),
    "s-niah-3": (("ccq_s_niah_3",), "S-NIAH-3: UUID in essays"),
    "niah-multikey": (("ccq_niah_multikey_1", "ccq_niah_multikey_2", "ccq_niah_multikey_3"),
                      "RULER multi-key NIAH: distractor needles in essays; needles as haystack (words, UUIDs)"),
    "niah-multikey-1": (("ccq_niah_multikey_1",), "RULER multi-key NIAH 1: three distractor needles in essays"),
    "niah-multikey-2": (("ccq_niah_multikey_2",), "RULER multi-key NIAH 2: needles (words) as the haystack"),
    "niah-multikey-3": (("ccq_niah_multikey_3",), "RULER multi-key NIAH 3: needles (UUIDs) as the haystack"),
    "niah-multivalue": (("ccq_niah_multivalue",), "RULER multi-value NIAH: four values under one key"),
    "niah-multiquery": (("ccq_niah_multiquery",), "RULER multi-query NIAH: four keys asked at once"),
    "ruler-vt": (("ccq_ruler_vt",), "RULER variable tracking: follow a chain of assignments"),
    "ruler-cwe": (("ccq_ruler_cwe",), "RULER common-words extraction: the 10 most common words of a list"),
    "ruler-fwe": (("ccq_ruler_fwe",), "RULER frequent-words extraction: the 3 most frequent coded words"),
    "ruler-qa": (RULER_QA_TASKS, "RULER QA: SQuAD v2 and HotpotQA among distractor documents (--qa-dir)"),
    "ppl": (("ccq_ppl_buckets", "ccq_ppl_sweep"), "length-extrapolation perplexity, both protocols"),
    "ppl-buckets": (("ccq_ppl_buckets",), "perplexity per position bucket of long blocks (fla evals/ppl.py)"),
    "ppl-sweep": (("ccq_ppl_sweep",), "perplexity of the first L tokens of documents, per L (YaRN)"),
    "longbench": (("ccq_longbench",), "LongBench v1, 21 datasets"),
    "longbench-e": (("ccq_longbench_e",), "LongBench-E, 13 English datasets by length bucket"),
    "zeroshot": (ZEROSHOT_TASKS, "the zero-shot table of the GLA / Gated DeltaNet papers: lm-eval's own "
                                 "wikitext, lambada_openai, piqa, hellaswag, winogrande, arc_easy, arc_challenge, "
                                 "boolq, sciq, copa, openbookqa, social_iqa"),
    "recall": (RECALL_TASKS, "the recall-intensive table of the Based / JRT papers: SWDE, SQuAD, FDA, TriviaQA, NQ, "
                             "DROP with the document in the prompt, cut around the answer (--recall-dir)"),
}
# Alias targets that are lm-eval's own tasks, not ours: they resolve as they are.
LMEVAL_ALIAS_TARGETS = frozenset(ZEROSHOT_TASKS)

# lm-eval's own port of RULER (lm_eval/tasks/ruler, lm-eval 0.4.13): its task names, its tag and the name of
# ours that runs the same RULER task. The port is not run under these names, nor quietly swapped for ours:
# its prompts, sizes, grid and QA scoring differ from ours (each task folder's README lists how), so numbers
# under its name would not be its numbers; it also loads its tokenizer from the hub and downloads its essays,
# and its variable-tracking example search never ends with a byte-level tokenizer. A name of it stops
# planning with one line that names ours (lm-eval's own CLI, `ccq-eval lm-eval run`, still runs the port).
LMEVAL_RULER_PORT: dict[str, str] = {
    **{f"niah_single_{i}": f"s-niah-{i}" for i in (1, 2, 3)},
    **{f"niah_multikey_{i}": f"niah-multikey-{i}" for i in (1, 2, 3)},
    "niah_multivalue": "niah-multivalue",
    "niah_multiquery": "niah-multiquery",
    "ruler_vt": "ruler-vt",
    "ruler_cwe": "ruler-cwe",
    "ruler_fwe": "ruler-fwe",
    "ruler_qa_squad": "ccq_ruler_qa_squad",
    "ruler_qa_hotpot": "ccq_ruler_qa_hotpot",
    "longcxt": "ruler",  # the port's tag of its 13 tasks (its group `ruler` is our alias)
}


class UnknownTaskError(UserError, KeyError, ValueError):
    """A task name that is neither an alias, one of our tasks, nor an lm-eval task."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class LmEvalPortTaskError(UnknownTaskError):
    """A name of lm-eval's RULER port (LMEVAL_RULER_PORT); the message names ours."""


def tasks_dir() -> Path:
    """The folder of the installed ccq_eval.tasks package, whose family folders lm-eval includes;
    CCQ_EVAL_TASKS_DIR points at another folder of the same layout instead."""
    override = os.environ.get("CCQ_EVAL_TASKS_DIR")
    if override:
        return Path(override)
    folder = importlib.resources.files(TASKS_PACKAGE)
    if not isinstance(folder, Path):  # lm-eval reads YAML files from folders, not from an archive
        raise FileNotFoundError(f"{TASKS_PACKAGE} is installed inside an archive ({folder}); install ccq-eval "
                                "as a wheel or editable (pip install -e .) so its task folders are files")
    return folder


def task_paths() -> list[str]:
    """Our task folders that exist (others may not be written yet in a partial checkout)."""
    folder = tasks_dir()
    if not folder.is_dir():
        raise FileNotFoundError(f"task folder {folder} not found: unset CCQ_EVAL_TASKS_DIR or point it at a "
                                "folder holding s_niah/, ppl/ and longbench/")
    return [str(folder / name) for name in TASK_FOLDERS if (folder / name).is_dir()]


@lru_cache(maxsize=1)
def _our_index() -> dict[str, Any]:
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([Path(p) for p in task_paths()])


@lru_cache(maxsize=1)
def _default_index() -> dict[str, Any]:
    """lm-eval's built-in index (about 8 s: built only when a non-ccq name is asked for)."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([Path(lm_eval.tasks.__file__).parent])


# The folders of lm-eval's task tree (lm_eval/tasks/, lm-eval 0.4.13) that hold the zero-shot suite's
# configs: indexed alone in well under a second, where the whole tree takes seconds. A suite name they do
# not hold (another lm-eval layout) falls back to the whole index.
ZEROSHOT_TASK_FOLDERS = ("wikitext", "lambada", "piqa", "hellaswag", "winogrande", "arc", "super_glue/boolq",
                         "sciq", "super_glue/copa", "openbookqa", "siqa")


@lru_cache(maxsize=1)
def _zeroshot_index() -> dict[str, Any]:
    """lm-eval's index of ZEROSHOT_TASK_FOLDERS (those that exist)."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    root = Path(lm_eval.tasks.__file__).parent
    return TaskIndex.build([root / name for name in ZEROSHOT_TASK_FOLDERS if (root / name).is_dir()])


def _yaml_stamp(folders: list[str]) -> tuple[tuple[str, int, int], ...]:
    """Every YAML file below `folders` (the task configs and their `_..._yaml` templates) with its mtime and
    size: what an index of those folders was built from."""
    files = sorted(path for folder in folders for path in Path(folder).rglob("*yaml") if path.is_file())
    return tuple((str(path), (stat := path.stat()).st_mtime_ns, stat.st_size) for path in files)


@lru_cache(maxsize=4)
def _folders_index(folders: tuple[str, ...], stamp: tuple[tuple[str, int, int], ...]) -> dict[str, Any]:
    """lm-eval's TaskIndex of `folders` as a TaskManager over them builds it (a run builds one manager per
    unit: this index is built again only when a YAML file below them changes, `stamp`)."""
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([Path(folder) for folder in folders])


def _make_manager_class():
    from lm_eval.tasks import TaskManager

    class CCQTaskManager(TaskManager):
        """TaskManager over our folders that indexes lm-eval's built-in tasks on first use of a name it
        does not know (ours keep precedence), so runs of our tasks skip the 8 s index; a zero-shot suite
        name indexes only the suite's folders (ZEROSHOT_TASK_FOLDERS)."""

        def __init__(self, *, include_defaults: bool = False, include_path: Any = None, **kwargs: Any) -> None:
            if not include_defaults and isinstance(include_path, list) and include_path == task_paths():
                # our folders alone (a run builds a manager per unit): their index is kept while their YAML
                # files stay as they were
                super().__init__(include_defaults=False, include_path=None, **kwargs)
                self.include_path = include_path
                self._add(_folders_index(tuple(include_path), _yaml_stamp(include_path)))
            else:
                super().__init__(include_defaults=include_defaults, include_path=include_path, **kwargs)
            self._defaults_loaded = include_defaults

        def _add_defaults(self) -> None:
            self._add(_default_index())
            self._defaults_loaded = True

        def _add(self, index: dict[str, Any]) -> None:
            """`index`'s entries beside ours (ours keep precedence), with the manager's name lists."""
            from lm_eval.tasks._index import Kind

            self._index = dict(index) | self._index
            self._all_tasks = sorted(self._index)
            kinds: dict[Any, list[str]] = {}
            for name, entry in self._index.items():
                kinds.setdefault(entry.kind, []).append(name)
            self._all_subtasks = sorted(kinds.get(Kind.TASK, []) + kinds.get(Kind.PY_TASK, []))
            self._all_groups = sorted(kinds.get(Kind.GROUP, []))
            self._all_tags = sorted(kinds.get(Kind.TAG, []))

        def _entry(self, name: str):
            entry = self._index.get(name)
            if entry is None and not self._defaults_loaded and not Path(name).suffix:
                if name in ZEROSHOT_TASKS and name in _zeroshot_index():
                    self._add(_zeroshot_index())
                else:
                    self._add_defaults()
                entry = self._index.get(name)
            return entry

    return CCQTaskManager


def make_task_manager(metadata: dict[str, Any] | None = None, *, include_defaults: bool = False,
                      extra_paths: list[str] | None = None):
    """A TaskManager over tasks/s_niah, tasks/ppl, tasks/longbench (plus `extra_paths`).

    `metadata` reaches every task (lengths, depths, samples_per_cell, tokenizer, data paths).
    Built-in lm-eval tasks are indexed lazily when a name outside ours is loaded, or eagerly
    with include_defaults=True."""
    manager_class = _make_manager_class()
    return manager_class(include_path=task_paths() + list(extra_paths or []),
                         include_defaults=include_defaults, metadata=dict(metadata or {}))


def _leaf_tasks(name: str, index: dict[str, Any], seen: set[str] | None = None) -> list[str]:
    """A group or tag of ours -> its leaf task names (in YAML order); a task -> [name]."""
    from lm_eval.tasks._index import Kind

    seen = set() if seen is None else seen
    if name in seen:
        return []
    seen.add(name)
    entry = index.get(name)
    if entry is None:
        raise UnknownTaskError(f"task {name!r} is referenced by our task configs but not defined in "
                               f"{tasks_dir()}")
    if entry.kind == Kind.GROUP:
        from lm_eval.tasks._yaml_loader import load_yaml

        config = entry.cfg or (load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else {})
        members = config.get("task") or []
        leaves: list[str] = []
        for member in members if isinstance(members, list) else [members]:
            child = member if isinstance(member, str) else (member.get("task") or member.get("group"))
            leaves += [leaf for leaf in _leaf_tasks(str(child), index, seen) if leaf not in leaves]
        return leaves
    if entry.kind == Kind.TAG:
        tagged = [n for n, e in index.items() if name in e.tags and e.kind in (Kind.TASK, Kind.PY_TASK)]
        return sorted(tagged)
    return [name]


def our_task_yaml(task_name: str) -> Path | None:
    """The YAML file that defines one of our tasks, as the run loads it; None for a name not ours."""
    yaml_path = getattr(_our_index().get(task_name), "yaml_path", None)
    return Path(yaml_path) if yaml_path is not None else None


def declared_config(task_name: str) -> dict[str, Any] | None:
    """The config (includes merged) of one of our tasks or of the zero-shot suite's, as lm-eval's index reads
    it; None for another lm-eval task (its index takes seconds to build)."""
    entry = _our_index().get(task_name)
    if entry is None and task_name in ZEROSHOT_TASKS:
        entry = _zeroshot_index().get(task_name)
    config = getattr(entry, "cfg", None)
    return dict(config) if isinstance(config, dict) else None


def task_truncation_policy(task_name: str | None) -> str | None:
    """The `ccq_truncation` a task of ours declares in its YAML metadata: the ccq adapter's policy for a
    prompt longer than the model's budget, kept out of generation_kwargs so that every lm-eval model can
    run the task; "left" for lm-eval's own recall tasks (HFLM's cut). None for a task that declares none or is
    not ours."""
    if task_name in RECALL_LMEVAL_TASKS:  # lm-eval's own recall tasks, as its HFLM cuts them (from the left)
        return "left"
    entry = _our_index().get(task_name) if task_name else None
    metadata = (entry.cfg or {}).get("metadata") if entry is not None else None
    return metadata.get("ccq_truncation") if isinstance(metadata, dict) else None


def our_task_names() -> list[str]:
    """Every task, group and tag name defined in our folders."""
    return sorted(_our_index())


def list_tasks() -> dict[str, str]:
    """User-facing names -> one-line description: aliases first, then our lm-eval names."""
    from lm_eval.tasks._index import Kind

    index = _our_index()
    names = {alias: description for alias, (_, description) in ALIASES.items()}
    for name in sorted(index):
        entry = index[name]
        kind = {Kind.GROUP: "group", Kind.TAG: "tag"}.get(entry.kind, "task")
        # A tag has no YAML file of its own: its folder is that of the tasks it tags.
        paths = [entry.yaml_path] if entry.yaml_path else [
            index[member].yaml_path for member in entry.tags if member in index]
        folders = sorted({Path(path).parent.name for path in paths if path})
        members = f" of {', '.join(sorted(entry.tags))}" if entry.kind == Kind.TAG and entry.tags else ""
        names.setdefault(name, f"lm-eval {kind}{members} in " + ", ".join(f"tasks/{f}" for f in folders))
    return names


def lmeval_ruler_port_message(name: str) -> str:
    """The one line that stops a name of lm-eval's RULER port (LMEVAL_RULER_PORT) and names ours."""
    ours = LMEVAL_RULER_PORT[name]
    targets = ALIASES[ours][0] if ours in ALIASES else (ours,)
    if len(targets) > 1:  # an alias of several tasks: what it holds
        which = f"{ours} ({ALIASES[ours][1]})"
    else:  # an alias of one task with its lm-eval name, or that name alone
        which = ours if targets[0] == ours else f"{ours} ({targets[0]})"
    return (f"task {name!r} is lm-eval's own port of RULER, which ccq-eval does not run: ours is {which}; "
            f"docs/tasks.md says how it follows RULER, and lm-eval's CLI runs the port (ccq-eval lm-eval run "
            f"--tasks {name} ...)")


def valid_names_message() -> str:
    return (f"valid names: {', '.join(ALIASES)}; our lm-eval tasks: {', '.join(our_task_names())}; "
            "or any lm-eval task name (see `lm-eval ls tasks`)")


def _lm_eval_defines(name: str) -> bool:
    """Whether lm-eval's task tree defines `name`: a zero-shot suite name is looked up in the suite's folders
    (well under a second), any other name in the whole tree's index (seconds, built once)."""
    return (name in ZEROSHOT_TASKS and name in _zeroshot_index()) or name in _default_index()


def resolve_tasks(names: list[str] | str, *, expand_groups: bool = True, ours_only: bool = False) -> list[str]:
    """User task names -> lm-eval task names, in order, without duplicates.

    Aliases and our groups expand to leaf tasks (unless expand_groups=False); other lm-eval
    names pass through when lm-eval knows them (never with ours_only), but for those of lm-eval's
    RULER port (LMEVAL_RULER_PORT). Raises UnknownTaskError (a KeyError) naming the valid choices,
    or for a name of the port, ours."""
    if isinstance(names, str):
        names = [part.strip() for part in names.split(",") if part.strip()]
    index = _our_index()
    resolved: list[str] = []
    for name in names:
        if name in LMEVAL_RULER_PORT and name not in ALIASES and name not in index:
            raise LmEvalPortTaskError(lmeval_ruler_port_message(name))
        if name in ALIASES:
            targets = list(ALIASES[name][0])
            missing = [t for t in targets if t not in index and t not in LMEVAL_ALIAS_TARGETS]
            if missing:
                raise UnknownTaskError(f"task alias {name!r} needs {', '.join(missing)}, which {tasks_dir()} "
                                       "does not define (is that task family installed?)")
        elif name in index:
            targets = [name]
        elif not ours_only and not name.startswith("ccq_") and _lm_eval_defines(name):  # ccq_ names: ours only
            resolved += [name] if name not in resolved else []
            continue
        else:
            close = difflib.get_close_matches(name, list(ALIASES) + our_task_names(), n=3, cutoff=0.7)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UnknownTaskError(f"unknown task {name!r}{hint}; {valid_names_message()}")
        for target in targets:
            leaves = _leaf_tasks(target, index) if expand_groups and target in index else [target]
            resolved += [leaf for leaf in leaves if leaf not in resolved]
    return resolved


class TaskCatalog(Protocol):
    """What planning and the runner need from a task registry (tests substitute their own)."""

    def aliases(self) -> dict[str, str]:
        """User-facing task names (aliases and our lm-eval tasks) -> one-line description."""

    def resolve(self, name: str) -> list[str]:
        """An alias or lm-eval task name -> lm-eval task names; KeyError when unknown."""

    def make_task_manager(self, metadata: dict[str, Any]) -> Any:
        """An lm_eval TaskManager that knows our tasks, with `metadata` for every task."""


class RegistryTaskCatalog:
    """TaskCatalog over this module: our task folders, and lm-eval's tasks by name."""

    def aliases(self) -> dict[str, str]:
        return dict(list_tasks())

    def resolve(self, name: str) -> list[str]:
        return list(resolve_tasks([name]))

    def make_task_manager(self, metadata: dict[str, Any]) -> Any:
        return make_task_manager(metadata=metadata)
