"""The zero-shot table of the GLA / Gated DeltaNet papers, run through lm-eval's own task configs.

    ZEROSHOT_TASKS                              the suite's lm-eval task names (task alias `zeroshot`)
    load_tasks(task_manager, names, data_dir)   -> what TaskManager.load returns, data errors as one line
    task_specs(task_manager, names, data_dir)   -> what to hand TaskManager.load: a name, or the task built
                                                   from lm-eval's config with its data source pointed at
                                                   <data_dir>/<task>/<split>.jsonl
    check_rows(task, path, dataset)             -> None, or ZeroshotDataError naming the file, line and field of
                                                   the first row the task's config cannot score
    rolling_protocol(task, asked)               -> "hflm" | "carry": how loglikelihood_rolling scores a task

The suite is what fla's README runs for "the task results reported in the GLA paper" (lm-eval's HFLM,
zero-shot, wikitext ... openbookqa) plus social_iqa, which the Gated DeltaNet paper adds; the papers'
columns and average are task_families.ZEROSHOT_PAPER_COLUMNS / ZEROSHOT_AVERAGED. The tasks are lm-eval's
configs, unchanged: prompts, choices, metrics and splits are lm-eval's.

Data: lm-eval loads each dataset with `datasets.load_dataset` (the hub when it is reachable, else the
user's datasets cache). Where neither holds it, ZeroshotDataError says in one line which dataset is
missing and the command that fetches it on a machine with the hub. A folder of local files in each
dataset's schema (`data_dir`, one `<task>/<split>.jsonl` per split) replaces the source through the
config's own keys (dataset_path json, dataset_kwargs.data_files), so the path from config to score stays
lm-eval's. Every row of those files is checked first (check_rows: the fields the task's config reads, their
types, label ranges): a bad row stops the unit with one line naming the file, the line and the field, before
anything is scored.

Protocol: lm-eval's HFLM scores wikitext (loglikelihood_rolling) in disjoint windows of its max_length,
each read afresh; the ccq adapter by default reads a whole text in one recurrent pass. The suite's
rolling tasks use the HFLM windows unless the adapter is asked otherwise (model arg rolling_windows=carry);
the adapter records which protocol scored each task in its model info (results["config"]).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ccq_eval.data.json_rows import checked_rows
from ccq_eval.errors import UserError
from ccq_eval.task_families import ZEROSHOT_AVERAGED, ZEROSHOT_PAPER_COLUMNS, ZEROSHOT_TASKS

__all__ = ["ROLLING_PROTOCOLS", "ZEROSHOT_AVERAGED", "ZEROSHOT_PAPER_COLUMNS", "ZEROSHOT_TASKS", "ZeroshotDataError",
           "check_data", "check_rows", "load_tasks", "local_overrides", "missing_data_message", "rolling_protocol",
           "row_problem", "task_specs", "unreachable_hub_message"]

# How loglikelihood_rolling scores a text: "hflm", lm-eval HFLM's disjoint windows of max_length tokens with
# one token of context, each window read from an empty state; "carry", the whole text in one pass, the
# state carried from slice to slice (the adapter's default for every other task).
ROLLING_PROTOCOLS = ("hflm", "carry")
# Rolling tasks the published tables score with HFLM's windows.
HFLM_ROLLING_TASKS = frozenset({"wikitext"})
# The split keys of an lm-eval task config; the evaluated split is test_split, else validation_split.
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
# The group a local-data task is built inside (lm-eval's documented way to override a registered task's
# keys); only its tasks are kept.
_CARRIER_GROUP = "ccq_zeroshot_local_data"


class ZeroshotDataError(UserError, RuntimeError):
    """A dataset of the suite that neither the hub, the datasets cache nor the local folder provides."""


def rolling_protocol(task_name: str | None, asked: str | None = None) -> str:
    """The protocol that scores `task_name`'s loglikelihood_rolling requests: `asked` when given (the
    adapter's rolling_windows), else "hflm" for the suite's rolling tasks and "carry" for all others."""
    if asked is not None:
        if asked not in ROLLING_PROTOCOLS:
            raise ValueError(f"rolling_windows must be one of {', '.join(ROLLING_PROTOCOLS)}; got {asked!r}")
        return asked
    return "hflm" if task_name in HFLM_ROLLING_TASKS else "carry"


def task_config(task_manager: Any, name: str) -> dict[str, Any]:
    """lm-eval's config of task `name` as its YAML says it (includes resolved, !function hooks not loaded)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager._entry(name)  # also makes ccq's TaskManager index lm-eval's built-in tasks
    if entry is None:
        raise ZeroshotDataError(f"lm-eval has no task {name!r}; the zero-shot suite is {', '.join(ZEROSHOT_TASKS)}")
    return dict(load_yaml(entry.yaml_path, resolve_func=False)) if entry.yaml_path else dict(entry.cfg or {})


def evaluated_split(config: dict[str, Any]) -> str:
    """The split lm-eval evaluates a task on: its test split, else its validation split."""
    return str(config.get("test_split") or config.get("validation_split"))


def fetch_command(config: dict[str, Any]) -> str:
    """The command that puts a task's dataset into the datasets cache on a machine with the hub."""
    args = ", ".join(repr(a) for a in (config.get("dataset_path"), config.get("dataset_name")) if a is not None)
    return f'python -c "import datasets; datasets.load_dataset({args})"'


def missing_data_message(name: str, config: dict[str, Any]) -> str:
    """One line: which dataset task `name` lacks, and how to get it."""
    dataset = config.get("dataset_path")
    if config.get("dataset_name"):
        dataset = f"{dataset} ({config['dataset_name']})"
    return (f"task {name}: dataset {dataset} is neither reachable on the Hugging Face hub nor in the datasets "
            f"cache; fetch it where the hub is reachable with {fetch_command(config)} and use that machine's "
            f"Hugging Face cache (HF_HOME) here, or pass --zeroshot-dir FOLDER holding {name}/"
            f"{evaluated_split(config)}.jsonl in that dataset's schema")


def unreachable_hub_message(name: str, config: dict[str, Any]) -> str:
    """One line: the hub is allowed but cannot be reached, so task `name`'s dataset comes from the cache
    only in offline mode, or from a folder."""
    return (f"task {name}: the Hugging Face hub cannot be reached from here and HF_HUB_OFFLINE is unset; set "
            f"HF_HUB_OFFLINE=1 to read {config.get('dataset_path')} from the datasets cache, or pass "
            f"--zeroshot-dir FOLDER holding {name}/{evaluated_split(config)}.jsonl in that dataset's schema")


def local_overrides(name: str, config: dict[str, Any], data_dir: str | Path) -> dict[str, Any] | None:
    """The config keys that make task `name` read <data_dir>/<name>/<split>.jsonl (lm-eval's json loader):
    dataset_path json, no dataset_name, data_files for each split of the config that has a file, and the
    config's other splits unset. None when the folder has no <name>/ subfolder. Raises ZeroshotDataError
    when the subfolder lacks the split lm-eval evaluates (another split would change the benchmark)."""
    folder = Path(data_dir) / name
    if not folder.is_dir():
        return None
    splits = {str(config[key]) for key in SPLIT_KEYS if config.get(key)}
    files = {split: folder / f"{split}.jsonl" for split in sorted(splits) if (folder / f"{split}.jsonl").is_file()}
    evaluated = evaluated_split(config)
    if evaluated not in files:
        raise ZeroshotDataError(f"{folder / (evaluated + '.jsonl')} not found: lm-eval's {name} is evaluated on "
                                f"its {evaluated} split; put that split there in {config.get('dataset_path')}'s schema")
    overrides: dict[str, Any] = {"dataset_path": "json", "dataset_name": None,
                                 "dataset_kwargs": {"data_files": {split: str(path) for split, path in files.items()}}}
    for key in SPLIT_KEYS:
        if config.get(key) and str(config[key]) not in files:
            overrides[key] = None
    return overrides


# The fields of a dataset row that a task's lm-eval config reads (doc_to_text, doc_to_target, doc_to_choice,
# process_docs), in order, each with its check: what the value must be, or None when it is. A check may read
# the fields listed above it (a label's range is its row's number of endings). lm-eval scores a label out of
# range, or of another type, as a wrong answer, and turns a null text into "None" in the prompt.
RowCheck = Callable[[Any, dict[str, Any]], str | None]


def _text(value: Any, row: dict[str, Any]) -> str | None:
    return None if isinstance(value, str) else "a string"


def _words(value: Any, row: dict[str, Any]) -> str | None:
    return None if isinstance(value, str) and value.strip() else "a non-empty string"


def _texts(value: Any, row: dict[str, Any]) -> str | None:
    ok = isinstance(value, list) and value and all(isinstance(item, str) for item in value)
    return None if ok else "a non-empty list of strings"


def _one_of(*allowed: Any) -> RowCheck:
    """Exactly one of `allowed`, type included (1 is not "1", and false is not 0)."""
    def check(value: Any, row: dict[str, Any]) -> str | None:
        if any(type(value) is type(choice) and value == choice for choice in allowed):
            return None
        return "one of " + ", ".join(json.dumps(choice) for choice in allowed)
    return check


def _blank_in_sentence(value: Any, row: dict[str, Any]) -> str | None:
    return None if isinstance(value, str) and "_" in value else "a string with the blank _ the options fill"


def _choices(value: Any, row: dict[str, Any]) -> str | None:
    ok = (isinstance(value, dict) and _texts(value.get("text"), row) is None
          and _texts(value.get("label"), row) is None and len(value["text"]) == len(value["label"]))
    return None if ok else '{"text": [choices], "label": [their labels]}, two lists of strings of one length'


def _answer_key(value: Any, row: dict[str, Any]) -> str | None:
    labels = row["choices"]["label"]
    ok = isinstance(value, str) and value.lstrip() in labels  # openbookqa's config strips it, arc's has none to strip
    return None if ok else "one of the row's choices.label " + json.dumps(labels)


def _ending_index(value: Any, row: dict[str, Any]) -> str | None:
    endings = len(row["endings"])
    ok = ((isinstance(value, str) and value.isdigit()) or (type(value) is int)) and 0 <= int(value) < endings
    return None if ok else f"the index of the right ending, 0 to {endings - 1} (a string such as \"0\")"


_CHOICE_QA: tuple[tuple[str, RowCheck], ...] = (("question", _text), ("choices", _choices),
                                                 ("answerKey", _answer_key))
ROW_FIELDS: dict[str, tuple[tuple[str, RowCheck], ...]] = {
    "wikitext": (("page", _text),),
    "lambada_openai": (("text", _words),),
    "piqa": (("goal", _text), ("sol1", _text), ("sol2", _text), ("label", _one_of(0, 1))),
    "hellaswag": (("activity_label", _text), ("ctx_a", _text), ("ctx_b", _text), ("endings", _texts),
                  ("label", _ending_index)),
    "winogrande": (("sentence", _blank_in_sentence), ("option1", _text), ("option2", _text),
                   ("answer", _one_of("1", "2"))),
    "arc_easy": _CHOICE_QA,
    "arc_challenge": _CHOICE_QA,
    "boolq": (("question", _text), ("passage", _text), ("label", _one_of(0, 1))),
    "sciq": tuple((name, _text) for name in ("question", "support", "correct_answer", "distractor1", "distractor2",
                                             "distractor3")),
    "copa": (("premise", _words), ("choice1", _words), ("choice2", _words), ("question", _one_of("cause", "effect")),
             ("label", _one_of(0, 1))),
    "openbookqa": (("question_stem", _text), ("choices", _choices), ("answerKey", _answer_key)),
    "social_iqa": (("context", _text), ("question", _text), ("answerA", _text), ("answerB", _text), ("answerC", _text),
                   ("label", _one_of("1", "2", "3"))),
}


def _shown(value: Any) -> str:
    """A row's value as its JSON spells it (null, 5, {"a": 1}), cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def row_problem(name: str, row: Any) -> str | None:
    """What makes one parsed row of task `name`'s data unusable ("field 'label' is 5, expected one of 0, 1"),
    or None; None for every row of a task without an entry in ROW_FIELDS."""
    fields = ROW_FIELDS.get(name, ())
    if not isinstance(row, dict):
        return f"expected a JSON object (a row of {name}'s dataset), got {_shown(row)}"
    for field, check in fields:
        if field not in row:
            return f"field '{field}' is missing"
        expected = check(row[field], row)
        if expected is not None:
            return f"field '{field}' is {_shown(row[field])}, expected {expected}"
    return None


def check_rows(name: str, path: str | Path, dataset: str | None = None) -> None:
    """ZeroshotDataError naming `path`, the line and the field of the first row of task `name`'s local data
    file that lm-eval's config cannot score as it means to (row_problem), and saying what to do; also for a
    line that is not JSON and a file with no row. `dataset`: the hub dataset whose schema the file follows."""
    schema = f"rows in {dataset}'s schema" if dataset else "rows in the dataset's schema"
    fix = f"fix or remove that row (--zeroshot-dir holds {schema})"
    if not checked_rows(path, lambda row: row_problem(name, row), ZeroshotDataError, fix):
        raise ZeroshotDataError(f"{path} holds no rows: give task {name} its split there, {schema}")


def task_specs(task_manager: Any, names: list[str], data_dir: str | Path | None = None) -> list[Any]:
    """For each name, what TaskManager.load takes: the name itself, or, where `data_dir` has the task's
    files, the lm-eval Task built from its registered config with local_overrides applied (the config's
    YAML, hooks and metadata as lm-eval builds them; config_source stays that YAML), once every row of those
    files passed check_rows."""
    specs: list[Any] = []
    for name in names:
        config = task_config(task_manager, name)
        overrides = local_overrides(name, config, data_dir) if data_dir else None
        if overrides is None:
            specs.append(name)
            continue
        for path in overrides["dataset_kwargs"]["data_files"].values():  # every row, before lm-eval reads any
            check_rows(name, path, config.get("dataset_path"))
        with _data_errors(name, {"dataset_path": "json", "dataset_name": None}):
            loaded = task_manager.load([{"group": _CARRIER_GROUP, "task": [{"task": name, **overrides}]}])
        specs.append(loaded["tasks"][name])
    return specs


def load_tasks(task_manager: Any, names: list[str], data_dir: str | Path | None = None) -> dict[str, Any]:
    """TaskManager.load over task_specs(...), one task at a time so that a dataset no source provides
    stops the run with ZeroshotDataError naming it (lm-eval raises ConnectionError / FileNotFoundError)."""
    merged: dict[str, dict[str, Any]] = {"tasks": {}, "groups": {}, "group_map": {}}
    for name, spec in zip(names, task_specs(task_manager, names, data_dir), strict=True):
        config = task_config(task_manager, name) if isinstance(spec, str) else {}
        with _data_errors(name, config):
            loaded = task_manager.load([spec])
        for key, values in merged.items():
            values.update(loaded.get(key) or {})
    return merged


def check_data(task_manager: Any, names: list[str], data_dir: str | Path | None = None) -> None:
    """Before a run: raise ZeroshotDataError (one line) for the first task whose dataset neither `data_dir`,
    the hub nor the datasets cache provides. Asks `datasets` for each dataset's builder only (no download
    of the data itself; offline it reads the cache)."""
    import datasets

    from ccq_eval.harness.fingerprints import hub_unreachable

    for name in names:
        config = task_config(task_manager, name)
        if data_dir and local_overrides(name, config, data_dir) is not None:
            continue
        if hub_unreachable():  # known before datasets would retry the hub
            raise ZeroshotDataError(unreachable_hub_message(name, config))
        with _data_errors(name, config):
            datasets.load_dataset_builder(config.get("dataset_path"), config.get("dataset_name"))


@contextmanager
def _data_errors(name: str, config: dict[str, Any]) -> Iterator[None]:
    """Turns the errors `datasets` raises for a dataset it cannot find (ConnectionError: hub unreachable and
    nothing cached; FileNotFoundError: no such dataset or file) into ZeroshotDataError naming task `name`."""
    try:
        yield
    except (ConnectionError, FileNotFoundError) as error:
        if config.get("dataset_path") in (None, "json"):
            reason = " ".join(str(error).split())
            raise ZeroshotDataError(f"task {name}: its local data could not be read ({reason})") from error
        raise ZeroshotDataError(missing_data_message(name, config)) from error
