"""lm-eval hooks for the LongBench family: data loading, prompt, scoring.

lm-eval imports this file by path (`!function utils.<name>`); the sibling modules come from the
installed package (ccq_eval.tasks.longbench), so each is loaded once per process however this file was.

Metadata keys read by `load_longbench` (from TaskManager(metadata=...) or lm-eval's --metadata):
  data_dir            folder holding the official jsonl files (<dataset>.jsonl, <dataset>_e.jsonl),
                      e.g. the unzipped data.zip of THUDM/LongBench (its data/ subfolder is also found)
  longbench_from_hub  true: when no data_dir is given, fetch data.zip of the hub dataset
                      THUDM/LongBench through huggingface_hub (needs network access to the hub)
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

from ccq_eval.tasks.longbench import metrics, spec

from ccq_eval.errors import UserError

HUB_REPO_ID = "THUDM/LongBench"
HUB_ZIP_NAME = "data.zip"
# Columns of the official records, kept in every doc; ccq_dataset is ours (the dataset name without
# the _e suffix), used to pick the template and metric.
RECORD_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "y", "on"}
    return bool(value)


def _file_name(dataset: str, longbench_e: bool) -> str:
    return f"{dataset}_e.jsonl" if longbench_e else f"{dataset}.jsonl"


def _find_local_file(data_dir: str | Path, file_name: str) -> Path:
    folder = Path(data_dir).expanduser()
    for candidate in (folder / file_name, folder / "data" / file_name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"LongBench file {file_name!r} not found in data_dir {str(folder)!r} (looked at "
        f"{folder / file_name} and {folder / 'data' / file_name}). Put the official jsonl files there "
        f"(unzip {HUB_ZIP_NAME} of the hub dataset {HUB_REPO_ID}) or point metadata data_dir at the "
        "folder that holds them"
    )


def _lines_from_hub(file_name: str) -> tuple[list[str], str]:
    try:
        from huggingface_hub import hf_hub_download

        zip_path = hf_hub_download(repo_id=HUB_REPO_ID, filename=HUB_ZIP_NAME, repo_type="dataset")
    except Exception as err:  # offline, unreachable, missing repo: all end the same way for the user
        raise RuntimeError(
            f"could not get {HUB_ZIP_NAME} of the hub dataset {HUB_REPO_ID} ({type(err).__name__}: {err}); "
            "download and unzip it where the hub is reachable and pass metadata data_dir=<that folder>"
        ) from err
    member = f"data/{file_name}"
    with zipfile.ZipFile(zip_path) as archive:  # read the one member; nothing is extracted to disk
        if member not in archive.namelist():
            raise FileNotFoundError(f"{zip_path} has no member {member!r}")
        text = archive.read(member).decode("utf-8")
    return text.splitlines(), f"{zip_path}:{member}"


class LongBenchDataError(UserError, ValueError):
    """A LongBench data file or record that cannot be scored as LongBench scores it; the message names the
    file, the line and the field, and what to do."""


def _shown(value: Any) -> str:
    """A record's value as its JSON spells it (null, 5, {"a": 1}), cut to 60 characters."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_text_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def record_problem(raw: Any, dataset: str) -> str | None:
    """What makes one parsed line of `dataset`'s file unusable ("field 'context' is null, expected ..."), or
    None. A record must hold the fields the prompt and the metric read, of the official types: `input` and
    `context` strings, `answers` a non-empty list of strings (the score is the best over them, so an empty
    list would score 0 whatever the model answers), `length` an integer (LongBench-E's bucket); where present,
    `dataset`, `language` and `_id` strings and `all_classes` a list of strings or null. trec and lsht need
    `all_classes` (their metric matches the classes), the passage-retrieval datasets gold answers that name
    the paragraph ("Paragraph 3", "段落3")."""
    if not isinstance(raw, dict):
        return f"expected a JSON object (a LongBench record), got {_shown(raw)}"
    missing = [name for name in ("input", "context", "answers", "length") if name not in raw]
    if missing:
        return f"record lacks {', '.join(missing)}; LongBench records have fields {', '.join(RECORD_FIELDS)}"
    for name in ("input", "context"):
        if not isinstance(raw[name], str):
            return f"field '{name}' is {_shown(raw[name])}, expected a string"
    answers = raw["answers"]
    if not _is_text_list(answers):
        return f"field 'answers' is {_shown(answers)}, expected a list of strings (the gold answers)"
    if not answers:
        return "field 'answers' is an empty list: a record needs at least one gold answer"
    length = raw["length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        return f"field 'length' is {_shown(length)}, expected a whole number >= 0 (the record's length)"
    for name in ("dataset", "language", "_id"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            return f"field '{name}' is {_shown(raw[name])}, expected a string or null"
    named = raw.get("dataset")
    if isinstance(named, str):
        # A record naming another LongBench dataset means the file is not the one its name says.
        base = named[:-2] if named.endswith("_e") and named[:-2] in spec.DATASET_PROMPT else named
        if base in spec.DATASET_PROMPT and base != dataset:
            return f"record of dataset {named!r}, expected {dataset!r}"
    all_classes = raw.get("all_classes")
    if all_classes is not None and not _is_text_list(all_classes):
        return f"field 'all_classes' is {_shown(all_classes)}, expected a list of strings or null"
    metric = spec.DATASET_METRIC[dataset]
    if metric == "classification_score" and not all_classes:
        return f"field 'all_classes' is {_shown(all_classes)}: {dataset} is scored against its list of classes"
    if metric in metrics.PARAGRAPH_PATTERNS:
        for answer in answers:
            if not re.search(metrics.PARAGRAPH_PATTERNS[metric], answer):
                return (f"gold answer {_shown(answer)} in field 'answers' names no paragraph "
                        f"(pattern {metrics.PARAGRAPH_PATTERNS[metric]!r}), which {dataset} is scored by")
    return None


def _parse_records(lines: list[str], source: str, dataset: str) -> list[dict[str, Any]]:
    """The records of `dataset`'s file, each checked (record_problem) before anything is scored: a bad line
    stops the unit with LongBenchDataError naming the file, the line and the field."""
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            raise LongBenchDataError(f"{source} line {line_number}: not valid JSON ({err}); fix or remove "
                                     "that line") from err
        problem = record_problem(raw, dataset)
        if problem is not None:
            raise LongBenchDataError(f"{source} line {line_number}: {problem}; fix or remove that record")
        record = {field: raw.get(field) for field in RECORD_FIELDS}
        record["ccq_dataset"] = dataset
        records.append(record)
    if not records:
        raise LongBenchDataError(f"{source} holds no records: give the official {dataset} file")
    return records


def load_longbench(longbench_dataset: str, longbench_e: bool = False, data_dir: str | None = None,
                   longbench_from_hub: bool = False, **_other_metadata: Any) -> dict[str, Any]:
    """custom_dataset hook: {"test": datasets.Dataset} of one LongBench (-E) dataset.

    lm-eval calls it as fn(**metadata, **dataset_kwargs); the YAML's dataset_kwargs name the dataset
    (longbench_dataset, longbench_e), the user's metadata gives data_dir or longbench_from_hub, and
    every other metadata key (version, other task families' settings) is ignored.
    """
    import datasets  # lm-eval depends on it; imported here to keep this module cheap

    longbench_e = _as_bool(longbench_e)
    known = spec.LONGBENCH_E_DATASETS if longbench_e else spec.LONGBENCH_DATASETS
    if longbench_dataset not in known:
        raise ValueError(f"unknown LongBench{'-E' if longbench_e else ''} dataset {longbench_dataset!r}; "
                         f"valid: {', '.join(known)}")
    if spec.DATASET_METRIC[longbench_dataset] in spec.JIEBA_METRICS:
        metrics.load_jieba()  # fail now, not after hours of generation, when jieba is missing

    file_name = _file_name(longbench_dataset, longbench_e)
    if data_dir:
        path = _find_local_file(data_dir, file_name)
        lines, source = path.read_text(encoding="utf-8").splitlines(), str(path)
    elif _as_bool(longbench_from_hub):
        lines, source = _lines_from_hub(file_name)
    else:
        raise ValueError(
            f"no LongBench data for {file_name}: pass metadata data_dir=<folder holding {file_name}> "
            f"(the official jsonl files, i.e. the unzipped {HUB_ZIP_NAME} of {HUB_REPO_ID}), or "
            "longbench_from_hub=true to fetch it from the Hugging Face hub"
        )
    records = _parse_records(lines, source, longbench_dataset)
    return {"test": datasets.Dataset.from_list(records)}


# ---------------------------------------------------------------------------------------------
# Prompt and scoring
# ---------------------------------------------------------------------------------------------


def doc_to_text(doc: dict[str, Any]) -> str:
    """The official template filled like pred.py's prompt_format.format(**record)."""
    return spec.DATASET_PROMPT[doc["ccq_dataset"]].format(context=doc["context"], input=doc["input"])


def score_doc(doc: dict[str, Any], prediction: str) -> float:
    """Sample score x 100: eval.py's first-line cut where it applies, then max over gold answers."""
    dataset = doc["ccq_dataset"]
    if dataset in spec.FIRST_LINE_DATASETS:
        prediction = metrics.first_line(prediction)
    return 100.0 * metrics.best_score(spec.DATASET_METRIC[dataset], prediction, doc["answers"],
                                      doc.get("all_classes"))


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    return {"score": score_doc(doc, results[0])}


def process_results_e(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """LongBench-E: the overall score plus the score under the record's length bucket only, so each
    score_<bucket> averages the samples of that bucket (eval.py scorer_e)."""
    value = score_doc(doc, results[0])
    return {"score": value, f"score_{spec.length_bucket(doc['length'])}": value}
