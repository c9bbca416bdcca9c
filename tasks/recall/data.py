"""The recall tasks' data: which dataset each task reads, where its rows are, and their checks.

    dataset_for(task, recall_length)    -> RecallDataset (hub id, folder name, split, fields read)
    local_file(dataset, recall_dir)     -> Path of <recall_dir>/<folder>/<split>.jsonl, or None
    load_rows(task, recall_length, recall_dir, prompt_mode) -> the rows (checked), from the folder or the hub
    row_problem(dataset, row, mode)     -> what makes one row unusable, or None
    missing_data_message(names)         -> one line: the datasets missing, and the command that fetches them

The datasets are HazyResearch's `based-*` sets that the JRT harness reads (their `validation` split), in
each dataset's own field layout; lm-eval 0.4.13's `swde`, `fda` and `squad_completion` read the first three
of them. A local folder holds one `<folder>/validation.jsonl` per dataset (the folder names are FOLDERS).
Without a file there, rows come from the hub when the hub may be used (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE
unset), else from the datasets cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccq_eval.data.json_rows import checked_rows
from ccq_eval.errors import UserError

SPLIT = "validation"
NQ_LENGTHS = (512, 1024, 2048)


class RecallDataError(UserError, ValueError):
    """Data of a recall task that no source provides, or a row its prompt cannot be built from."""


@dataclass(frozen=True)
class RecallDataset:
    """One dataset: its hub id (and config name), the folder that holds it under --recall-dir, and the fields
    the prompts read (those only the read-twice prompt reads apart)."""

    hub_id: str
    folder: str
    fields: tuple[str, ...]
    twice_fields: tuple[str, ...] = ()
    hub_config: str | None = None

    @property
    def file_name(self) -> str:
        return f"{self.folder}/{SPLIT}.jsonl"

    def fetch_command(self) -> str:
        args = ", ".join(repr(a) for a in (self.hub_id, self.hub_config) if a is not None)
        return f"datasets.load_dataset({args})"


# Hub ids as the reference's task classes name them (DATASET_PATH / DATASET_NAME).
DATASETS: dict[str, RecallDataset] = {
    "swde": RecallDataset("hazyresearch/based-swde-v2", "swde", ("text", "key", "value"), hub_config="default"),
    "fda": RecallDataset("hazyresearch/based-fda", "fda", ("text", "key", "value"), hub_config="default"),
    "squad": RecallDataset("hazyresearch/based-squad", "squad", ("text", "value"), ("context", "question"),
                           hub_config="default"),
    "triviaqa": RecallDataset("hazyresearch/based_triviaqa", "triviaqa", ("context", "question", "answers"),
                              ("orig_question",)),
    "drop": RecallDataset("hazyresearch/based_drop", "drop", ("context", "question", "answers"), ("orig_question",)),
    **{f"nq_{n}": RecallDataset(f"hazyresearch/based_nq_{n}", f"nq_{n}", ("context", "question", "answers"),
                                ("orig_question",)) for n in NQ_LENGTHS},
}
FOLDERS = tuple(DATASETS)
# Our jrt tasks and lm-eval's own tasks -> the dataset they read (NQ: per --recall-length, dataset_for).
TASK_DATASETS = {
    "ccq_recall_swde": "swde", "ccq_recall_fda": "fda", "ccq_recall_squad": "squad",
    "ccq_recall_triviaqa": "triviaqa", "ccq_recall_drop": "drop",
    "swde": "swde", "fda": "fda", "squad_completion": "squad",
}


def dataset_for(task: str, recall_length: int | None = None) -> RecallDataset:
    """The dataset `task` reads; NQ's is the one built for `recall_length` (512, 1024 or 2048 tokens)."""
    if task == "ccq_recall_nq":
        length = int(recall_length or 2048)
        if length not in NQ_LENGTHS:
            raise RecallDataError(f"ccq_recall_nq reads hazyresearch/based_nq_<L> for L in "
                                  f"{', '.join(map(str, NQ_LENGTHS))}; --recall-length {length} has no NQ dataset: "
                                  "give one of those lengths, or leave NQ out")
        return DATASETS[f"nq_{length}"]
    return DATASETS[TASK_DATASETS[task]]


def local_file(dataset: RecallDataset, recall_dir: str | Path | None) -> Path | None:
    """<recall_dir>/<folder>/validation.jsonl when it exists, else None."""
    if not recall_dir:
        return None
    path = Path(recall_dir) / dataset.file_name
    return path if path.is_file() else None


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def row_problem(dataset: RecallDataset, row: Any, prompt_mode: str = "once") -> str | None:
    """What makes one parsed row unusable for the prompts ("field 'key' is "", expected a non-empty string"),
    or None. Checked: the fields the prompts read exist with the reference's types; keys and questions are
    non-empty (an empty one makes the reference's prompt code loop forever or fail); SWDE's text holds its
    summary marker exactly once (the reference splits there); answers are a non-empty list of strings."""
    from ccq_eval.tasks.recall.jrt import SWDE_MARKER

    if not isinstance(row, dict):
        return f"expected a JSON object (a row of {dataset.hub_id}), got {_shown(row)}"
    fields = dataset.fields + (dataset.twice_fields if prompt_mode == "twice" else ())
    for field in fields:
        if field not in row:
            return f"field '{field}' is missing"
        value = row[field]
        if field == "answers":
            if not (isinstance(value, list) and value and all(isinstance(item, str) for item in value)):
                return f"field 'answers' is {_shown(value)}, expected a non-empty list of strings"
        elif not isinstance(value, str):
            return f"field '{field}' is {_shown(value)}, expected a string"
        elif field in ("key", "question") and not value.strip():
            return f"field '{field}' is {_shown(value)}, expected a non-empty string"
    if dataset.folder == "swde" and row["text"].count(SWDE_MARKER) != 1:
        return (f"field 'text' holds {row['text'].count(SWDE_MARKER)} copies of {SWDE_MARKER!r}, expected one "
                "(the question follows it)")
    return None


def read_file(path: Path, dataset: RecallDataset, prompt_mode: str = "once") -> list[dict[str, Any]]:
    """The rows of one local file, each checked (row_problem); RecallDataError naming the file, the line and
    the field of the first bad row, or saying the file holds no row."""
    fix = f"fix or remove that row (--recall-dir holds rows in {dataset.hub_id}'s field layout)"
    rows = checked_rows(path, lambda row: row_problem(dataset, row, prompt_mode), RecallDataError, fix)
    if not rows:
        raise RecallDataError(f"{path} holds no rows: put {dataset.hub_id}'s {SPLIT} split there, one JSON row a line")
    return rows


def hub_rows(dataset: RecallDataset, prompt_mode: str = "once") -> list[dict[str, Any]]:
    """The dataset's validation rows through `datasets` (the hub, or the datasets cache offline), each checked;
    RecallDataError with missing_data_message when no source has it."""
    import datasets

    try:
        loaded = datasets.load_dataset(dataset.hub_id, dataset.hub_config, split=SPLIT)
    except (ConnectionError, FileNotFoundError, ValueError) as error:
        raise RecallDataError(missing_data_message([dataset])) from error
    rows = [dict(row) for row in loaded]
    for index, row in enumerate(rows):
        problem = row_problem(dataset, row, prompt_mode)
        if problem is not None:
            raise RecallDataError(f"{dataset.hub_id} ({SPLIT}) row {index}: {problem}")
    return rows


def load_rows(task: str, recall_length: int | None, recall_dir: str | Path | None,
              prompt_mode: str = "once") -> list[dict[str, Any]]:
    """The checked rows of `task`'s dataset: the --recall-dir file where there is one, else the hub / cache."""
    dataset = dataset_for(task, recall_length)
    path = local_file(dataset, recall_dir)
    return read_file(path, dataset, prompt_mode) if path is not None else hub_rows(dataset, prompt_mode)


def missing_data_message(missing: list[RecallDataset]) -> str:
    """One line naming the datasets no source holds, and how to get them."""
    names = ", ".join(dataset.hub_id for dataset in missing)
    fetch = "; ".join(dataset.fetch_command() for dataset in missing)
    files = ", ".join(dataset.file_name for dataset in missing)
    return (f"the recall tasks' data is missing: {names} (neither --recall-dir nor the Hugging Face hub or its "
            f"datasets cache holds it); where the hub is reachable run python -c \"import datasets; {fetch}\" "
            f"and use that machine's HF_HOME here, or pass --recall-dir FOLDER holding {files}")
