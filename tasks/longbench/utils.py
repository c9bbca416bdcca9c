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
import zipfile
from pathlib import Path
from typing import Any

from ccq_eval.tasks.longbench import metrics, spec

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


def _parse_records(lines: list[str], source: str, dataset: str) -> list[dict[str, Any]]:
    records = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source} line {line_number}: not valid JSON ({err})") from err
        if not isinstance(raw, dict):
            raise ValueError(
                f"{source} line {line_number}: expected a JSON object, got {type(raw).__name__}")
        missing = [field for field in ("input", "context", "answers", "length") if field not in raw]
        if missing:
            raise ValueError(f"{source} line {line_number}: record lacks {', '.join(missing)}; LongBench "
                             f"records have fields {', '.join(RECORD_FIELDS)}")
        answers = raw["answers"]
        if isinstance(answers, str) or not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise ValueError(f"{source} line {line_number}: 'answers' must be a list of strings, got {answers!r}")
        all_classes = raw.get("all_classes")
        if all_classes is not None and not isinstance(all_classes, list):
            raise ValueError(f"{source} line {line_number}: 'all_classes' must be a list or null")
        named = raw.get("dataset")
        if isinstance(named, str):
            # A record naming another LongBench dataset means the file is not the one its name says.
            base = named[:-2] if named.endswith("_e") and named[:-2] in spec.DATASET_PROMPT else named
            if base in spec.DATASET_PROMPT and base != dataset:
                raise ValueError(f"{source} line {line_number}: record of dataset {named!r}, "
                                 f"expected {dataset!r}")
        record = {field: raw.get(field) for field in RECORD_FIELDS}
        record["length"] = int(raw["length"])
        record["input"] = str(raw["input"])
        record["context"] = str(raw["context"])
        record["ccq_dataset"] = dataset
        records.append(record)
    if not records:
        raise ValueError(f"{source} holds no records")
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
