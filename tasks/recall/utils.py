"""lm-eval hooks of the recall tasks (ccq_recall_*): documents cut and prompted as the JRT harness does.

lm-eval calls each dataset builder as fn(**task_metadata). Metadata keys: tokenizer (required: the
evaluated model's, for the cut), recall_length (default 2048), recall_prompt ("once" or "twice"),
recall_dir (a folder of <dataset>/validation.jsonl; else the hub or the datasets cache). The rules live in
ccq_eval.tasks.recall.jrt, the data readers in ccq_eval.tasks.recall.data.

Each document keeps the row's fields the prompt and labels read, plus `prompt` (the model input), `labels`,
`window` (the first and end token of the kept text in the cut field's tokens) and `row` (its line in the
split); a document the reference drops (an anchor of 0-1 characters) is left out.
"""

from __future__ import annotations

import logging
from typing import Any

from ccq_eval.tasks.recall.data import RecallDataError, load_rows
from ccq_eval.tasks.recall.jrt import (
    PROMPT_MODES,
    SWDE_MARKER,
    TASKS,
    build_prompt,
    contains_score,
    cut_window,
    labels_of,
)

log = logging.getLogger(__name__)

DEFAULT_LENGTH = 2048


def _settings(metadata: dict[str, Any]) -> tuple[Any, int, str]:
    from ccq_eval.tasks.s_niah.construction import load_tokenizer

    spec = metadata.get("tokenizer") or metadata.get("pretrained")
    if not spec:
        raise RecallDataError("the recall tasks cut documents in the evaluated model's tokens: pass metadata "
                              "tokenizer=<model name, tokenizer folder or 'byt5'>")
    length = int(metadata.get("recall_length") or DEFAULT_LENGTH)
    mode = str(metadata.get("recall_prompt") or "once")
    if mode not in PROMPT_MODES:
        raise RecallDataError(f"recall_prompt {mode!r}: valid modes are {', '.join(PROMPT_MODES)}")
    return load_tokenizer(str(spec)), length, mode


def build_docs(task: str, rows: list[dict[str, Any]], tokenizer: Any, length: int, mode: str) -> list[dict[str, Any]]:
    """The documents of `task` from its dataset rows: each cut to `length` tokens (less the answer's 48) in
    `tokenizer`'s tokens around its anchor, then prompted under `mode`; dropped rows left out."""
    spec = TASKS[task]
    docs = []
    for index, row in enumerate(rows):
        doc = dict(row)
        if task == "ccq_recall_swde":  # the reference keeps the text before the summary line (validation_docs)
            doc["text"] = doc["text"].split(SWDE_MARKER)[0]
        cut = cut_window(doc[spec.cut_field], doc, spec.anchor_fields, tokenizer, length)
        if cut is None:
            continue
        doc[spec.cut_field], start, end = cut
        docs.append({"row": index, **{key: doc[key] for key in doc if key != spec.cut_field},
                     spec.cut_field: doc[spec.cut_field], "prompt": build_prompt(task, doc, mode),
                     "labels": labels_of(task, doc), "window": [start, end]})
    dropped = len(rows) - len(docs)
    if dropped:
        log.info("%s: %d of %d documents dropped (an anchor of 0-1 characters, as the reference does)",
                 task, dropped, len(rows))
    if not docs:
        raise RecallDataError(f"{task}: every document was dropped (each has an anchor of 0-1 characters)")
    return docs


def _dataset(task: str, metadata: dict[str, Any]) -> dict[str, Any]:
    import datasets

    tokenizer, length, mode = _settings(metadata)
    rows = load_rows(task, length, metadata.get("recall_dir"), mode)
    return {"test": datasets.Dataset.from_list(build_docs(task, rows, tokenizer, length, mode))}


def recall_swde(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_swde", metadata)


def recall_fda(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_fda", metadata)


def recall_squad(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_squad", metadata)


def recall_triviaqa(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_triviaqa", metadata)


def recall_nq(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_nq", metadata)


def recall_drop(**metadata: Any) -> dict[str, Any]:
    return _dataset("ccq_recall_drop", metadata)


def doc_to_text(doc: dict[str, Any]) -> str:
    return doc["prompt"]


def doc_to_target(doc: dict[str, Any]) -> str:
    return doc["labels"][0]


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    return {"contains": contains_score(results[0], doc["labels"])}
