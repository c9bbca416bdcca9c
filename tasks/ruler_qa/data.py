"""RULER QA data: where the SQuAD v2 and HotpotQA files are, and reading them as RULER does.

    qa_data_file("ccq_ruler_qa_squad", "~/qa")    -> Path("~/qa/dev-v2.0.json") or None
    qa_data_present("ccq_ruler_qa_hotpot", None)  -> False (no folder: only the hub could give it)
    load_qa_data("ccq_ruler_qa_squad", qa_dir)    -> QAData(questions, documents, source)

The readers follow NVIDIA RULER scripts/data/synthetic/qa.py (commit named in README.md): every
paragraph is a document, documents are de-duplicated and sorted by text; SQuAD keeps only its
answerable questions, each with its paragraph as gold document and the other paragraphs of its
article as preferred distractors. HotpotQA documents are "<title>\\n<sentences joined>"; RULER keeps
all ten paragraphs of a record as the question's documents, here the supporting-fact paragraphs are
the gold documents and the record's other paragraphs its preferred distractors (README.md, item 3).

Without a folder, the hub is used only when it may be (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset).
"""

from __future__ import annotations

import json
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

from ccq_eval.errors import UserError

log = logging.getLogger(__name__)

# task (or short name) -> dataset
TASK_DATASET = {
    "ccq_ruler_qa_squad": "squad", "squad": "squad",
    "ccq_ruler_qa_hotpot": "hotpotqa", "hotpotqa": "hotpotqa", "hotpot": "hotpotqa",
}
# File names looked for in qa_dir: the official name first, then the name RULER's download script
# (scripts/data/synthetic/json/download_qa_dataset.sh) saves it under.
FILE_NAMES = {
    "squad": ("dev-v2.0.json", "squad.json"),
    "hotpotqa": ("hotpot_dev_distractor_v1.json", "hotpotqa.json"),
}
DESCRIPTION = {"squad": "SQuAD v2 dev", "hotpotqa": "HotpotQA dev distractor"}
# Hub copies: SQuAD v2 through datasets (validation split, flattened rows); HotpotQA as the official
# file from the mirror RULER's download script falls back to, pinned to its revision.
SQUAD_HUB_ID = "rajpurkar/squad_v2"
HOTPOT_HUB_ID = "namlh2004/hotpotqa"
HOTPOT_HUB_REVISION = "7e54db4656209750ff487f6fdf8e39a66dba136b"
HUB_NAMES = {"squad": SQUAD_HUB_ID, "hotpotqa": f"{HOTPOT_HUB_ID}@{HOTPOT_HUB_REVISION[:7]}"}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


class QAError(UserError, ValueError):
    """Bad RULER QA data or settings; the message says what is wrong and what to do."""


class QADataMissingError(QAError):
    """Neither a qa_dir file nor the hub gave a dataset."""


class QAData(NamedTuple):
    """A dataset as RULER's readers return it, plus where it came from.

    questions: {"query", "outputs" (gold answers), "context" (gold document indices), "more_context"
    (preferred distractor indices)}; documents: sorted unique texts; source: a file name (never a
    path) or the hub copy's name."""

    questions: list[dict[str, Any]]
    documents: list[str]
    source: str


# ---------------------------------------------------------------- where the files are
def dataset_of(task: str) -> str:
    """'squad' or 'hotpotqa' for a task name (ccq_ruler_qa_squad / ccq_ruler_qa_hotpot) or a short name."""
    try:
        return TASK_DATASET[task]
    except KeyError:
        raise QAError(f"unknown RULER QA task {task!r}: use ccq_ruler_qa_squad or ccq_ruler_qa_hotpot") from None


def qa_data_file(task: str, qa_dir: str | os.PathLike[str] | None) -> Path | None:
    """The task's data file in qa_dir (official name first, then RULER's download name), or None."""
    if not qa_dir:
        return None
    folder = Path(qa_dir).expanduser()
    for name in FILE_NAMES[dataset_of(task)]:
        if (folder / name).is_file():
            return folder / name
    return None


def qa_data_present(task: str, qa_dir: str | os.PathLike[str] | None) -> bool:
    """Whether qa_dir holds the task's data file. Without qa_dir the task can only run from the hub:
    False here; hub_allowed() says whether it would try."""
    return qa_data_file(task, qa_dir) is not None


def hub_allowed() -> bool:
    """False when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value."""
    return not any(os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"} for var in _OFFLINE_VARS)


def _missing_message(dataset: str, reason: str) -> str:
    official, ruler_name = FILE_NAMES[dataset]
    return (
        f"no {DESCRIPTION[dataset]} data for RULER QA ({reason}): put {official} (the official file; RULER's "
        f"download name {ruler_name} works too) in a folder and pass --qa-dir DIR to ccq-eval run (metadata "
        f"qa_dir=DIR in lm-eval), or let it come from the Hugging Face hub ({HUB_NAMES[dataset]}): leave qa_dir "
        f"unset, with the hub reachable and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset"
    )


# ---------------------------------------------------------------- checking the records
def _shown(value: Any) -> str:
    """A value as its JSON spells it (null, 5, {"a": 1}), cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _text_problem(value: Any, name: str) -> str | None:
    """Why `value` cannot be the text `name` (a prompt part or a gold answer): not a string, or blank (a blank
    gold answer is a substring of every output, so it would score 100 whatever the model says)."""
    if not isinstance(value, str):
        return f"field '{name}' is {_shown(value)}, expected a string"
    if not value.strip():
        return f"field '{name}' is {_shown(value)}, an empty string"
    return None


def _record_error(source: str, where: str, problem: str, fix: str) -> QAError:
    return QAError(f"{source} {where}: {problem}; {fix}")


def _list_at(container: Any, key: str, source: str, where: str, fix: str) -> list[Any]:
    value = container.get(key) if isinstance(container, dict) else None
    if not isinstance(value, list):
        shown = "missing" if not isinstance(container, dict) or key not in container else _shown(value)
        raise _record_error(source, where, f"field '{key}' is {shown}, expected a list", fix)
    return value


def check_squad(raw: Any, source: str) -> None:
    """QAError naming the file, the record (its place in the JSON and its id) and the field, for the first
    SQuAD record RULER QA cannot use: every paragraph's `context` a non-empty string; every question a dict
    with `is_impossible` true or false where present and, when answerable (the only questions asked), a
    non-empty `question` and a non-empty `answers` list of {"text": non-empty string}."""
    fix = "fix or remove that record (the official SQuAD v2 dev file has none such)"
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        raise QAError(f"{source} is not a SQuAD v2 file: expected "
                      '{"data": [{"title", "paragraphs": [{"context", "qas": [...]}]}]}')
    for a, article in enumerate(raw["data"]):
        for p, paragraph in enumerate(_list_at(article, "paragraphs", source, f"data[{a}]", fix)):
            where = f"data[{a}].paragraphs[{p}]"
            problem = _text_problem(paragraph.get("context"), "context") if isinstance(paragraph, dict) else \
                f"expected a JSON object, got {_shown(paragraph)}"
            if problem:
                raise _record_error(source, where, problem, fix)
            for q, qa in enumerate(_list_at(paragraph, "qas", source, where, fix)):
                at = f"{where}.qas[{q}]"
                if not isinstance(qa, dict):
                    raise _record_error(source, at, f"expected a JSON object, got {_shown(qa)}", fix)
                at += f" (id {qa['id']})" if isinstance(qa.get("id"), str) else ""
                impossible = qa.get("is_impossible", False)
                if not isinstance(impossible, bool):
                    raise _record_error(source, at, f"field 'is_impossible' is {_shown(impossible)}, expected true "
                                        "or false", fix)
                if impossible:  # never asked: RULER leaves unanswerable questions out
                    continue
                problem = _text_problem(qa.get("question"), "question")
                if problem is None:
                    answers = qa.get("answers")
                    if not isinstance(answers, list) or not answers:
                        problem = (f"field 'answers' is {_shown(answers)}, expected a non-empty list of "
                                   "{\"text\": ...} for an answerable question")
                    else:
                        problem = next((f"in field 'answers', entry {k} is {_shown(answer)}, expected "
                                        "{\"text\": a non-empty string}"
                                        for k, answer in enumerate(answers)
                                        if not isinstance(answer, dict) or _text_problem(answer.get("text"), "text")),
                                       None)
                if problem:
                    raise _record_error(source, at, problem, fix)


def check_hotpotqa(raw: Any, source: str) -> None:
    """QAError naming the file, the record (its place in the list and its _id) and the field, for the first
    HotpotQA record RULER QA cannot use: a dict with a non-empty `question` and `answer`, `supporting_facts`
    a list of [title, sentence index] and `context` a list of [title, [sentences]], titles and sentences
    strings."""
    fix = "fix or remove that record (the official HotpotQA dev distractor file has none such)"
    if not isinstance(raw, list):
        raise QAError(f"{source} is not a HotpotQA distractor file: expected a JSON list of records, "
                      f"got {_shown(raw)}")
    for r, record in enumerate(raw):
        at = f"record {r}"
        if not isinstance(record, dict):
            raise _record_error(source, at, f"expected a JSON object, got {_shown(record)}", fix)
        at += f" (_id {record['_id']})" if isinstance(record.get("_id"), str) else ""
        problem = _text_problem(record.get("question"), "question") or _text_problem(record.get("answer"), "answer")
        if problem is None:
            facts = record.get("supporting_facts")
            if not isinstance(facts, list) or not all(
                    isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], int)
                    for f in facts):
                problem = f"field 'supporting_facts' is {_shown(facts)}, expected a list of [title, sentence index]"
        if problem is None:
            paragraphs = record.get("context")
            if not isinstance(paragraphs, list) or not paragraphs or not all(
                    isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], list)
                    and all(isinstance(sentence, str) for sentence in c[1]) for c in paragraphs):
                problem = (f"field 'context' is {_shown(paragraphs)}, expected a non-empty list of "
                           "[title, [sentences]]")
        if problem:
            raise _record_error(source, at, problem, fix)


# ---------------------------------------------------------------- readers (RULER qa.py)
def read_squad(raw: Any, source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's read_squad on the parsed official SQuAD v2 JSON, its records checked first (check_squad)."""
    check_squad(raw, source)
    articles = raw["data"]
    documents = sorted({p["context"] for article in articles for p in article["paragraphs"]})
    index = {text: i for i, text in enumerate(documents)}
    questions = []
    for article in articles:
        article_docs = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            gold = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if qa.get("is_impossible", False):  # SQuAD v2 marks every question; v1.1 has none
                    continue
                questions.append({
                    "query": qa["question"],
                    "outputs": [answer["text"] for answer in qa["answers"]],
                    "context": [gold],
                    "more_context": [i for i in article_docs if i != gold],
                })
    return questions, documents


def _hotpot_document(title: str, sentences: list[str]) -> str:
    return f"{title}\n{''.join(sentences)}"


def read_hotpotqa(raw: Any, source: str) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's read_hotpotqa on the parsed official HotpotQA JSON, its records checked first (check_hotpotqa),
    with each record's paragraphs split into gold (titles named in supporting_facts, in the record's order)
    and preferred distractors."""
    check_hotpotqa(raw, source)
    documents = sorted({_hotpot_document(t, p) for record in raw for t, p in record["context"]})
    index = {text: i for i, text in enumerate(documents)}
    questions, skipped = [], 0
    for record in raw:
        supporting = {title for title, _ in record["supporting_facts"]}
        paragraphs = [(t, index[_hotpot_document(t, p)]) for t, p in record["context"]]
        gold = list(dict.fromkeys(i for t, i in paragraphs if t in supporting))
        if not gold:
            skipped += 1
            continue
        questions.append({
            "query": record["question"],
            "outputs": [record["answer"]],
            "context": gold,
            "more_context": list(dict.fromkeys(i for _, i in paragraphs if i not in gold)),
        })
    if skipped:
        log.warning("%s: %d records have no paragraph named in their supporting_facts and are left out",
                    source, skipped)
    return questions, documents


READERS = {"squad": read_squad, "hotpotqa": read_hotpotqa}


def squad_from_rows(rows: Any) -> dict[str, Any]:
    """The official SQuAD v2 structure from the hub's flat rows (title, context, question, id, answers
    {text, answer_start}): articles by title and paragraphs by context, both in order of appearance."""
    articles: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], {})
        paragraph = paragraphs.setdefault(row["context"], {"qas": [], "context": row["context"]})
        answers = [{"text": t, "answer_start": s}
                   for t, s in zip(row["answers"]["text"], row["answers"]["answer_start"], strict=True)]
        paragraph["qas"].append({"question": row["question"], "id": row["id"], "answers": answers,
                                 "is_impossible": not answers})
    return {"version": "v2.0",
            "data": [{"title": title, "paragraphs": list(pars.values())} for title, pars in articles.items()]}


# ---------------------------------------------------------------- loading
@lru_cache(maxsize=4)
def _read_file(path: str, mtime_ns: int, size: int, dataset: str) -> QAData:
    del mtime_ns, size  # cache key only: a changed file is read again
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise QAError(f"could not read {path} as JSON ({type(err).__name__}: {err})") from None
    questions, documents = READERS[dataset](raw, path)  # errors name the whole path, the docs the file name
    return QAData(questions, documents, Path(path).name)


def _from_hub(dataset: str) -> QAData:
    if dataset == "squad":
        import datasets

        rows = datasets.load_dataset(SQUAD_HUB_ID, split="validation")
        raw = squad_from_rows(rows)
    else:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id=HOTPOT_HUB_ID, filename=FILE_NAMES["hotpotqa"][0],
                               revision=HOTPOT_HUB_REVISION, repo_type="dataset")
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    source = f"hub:{HUB_NAMES[dataset]}"
    questions, documents = READERS[dataset](raw, source)
    return QAData(questions, documents, source)


def load_qa_data(task: str, qa_dir: str | os.PathLike[str] | None = None) -> QAData:
    """The task's questions and documents from qa_dir, else from the hub when allowed; otherwise
    QADataMissingError (one line naming both ways)."""
    dataset = dataset_of(task)
    if qa_dir:
        folder = Path(qa_dir).expanduser()
        path = qa_data_file(task, folder)
        if path is None:
            where = f"qa_dir {str(folder)!r} is not a folder" if not folder.is_dir() else \
                f"qa_dir {str(folder)!r} has no {' or '.join(FILE_NAMES[dataset])}"
            raise QADataMissingError(_missing_message(dataset, where))
        stat = path.stat()
        data = _read_file(str(path.resolve()), stat.st_mtime_ns, stat.st_size, dataset)
    elif not hub_allowed():
        raise QADataMissingError(_missing_message(dataset, "no qa_dir given and the hub is off"))
    else:
        try:
            data = _from_hub(dataset)
        except QAError:
            raise
        except Exception as err:  # noqa: BLE001  (unreachable, missing repo, no network: the same advice)
            reason = " ".join(str(err).split())[:200]
            raise QADataMissingError(_missing_message(
                dataset, f"no qa_dir given and the hub failed: {type(err).__name__}: {reason}")) from None
    if not data.questions:
        raise QAError(f"{data.source} holds no answerable question: give the {DESCRIPTION[dataset]} file")
    return data
