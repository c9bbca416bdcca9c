"""scripts/recheck_grid.py's comparison: a rerun's unit against the committed one, naming the records and
the fields that differ (the replay itself needs the GPU the grid was made on)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recheck():
    spec = importlib.util.spec_from_file_location("recheck_grid", REPO / "scripts" / "recheck_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unit(root: Path, records: list[dict], accuracy: float = 0.5) -> Path:
    unit = root / "tiny-gla" / "ccq_s_niah_1"
    unit.mkdir(parents=True)
    (unit / "meta.json").write_text("{}")
    (unit / "results.json").write_text(json.dumps({"results": {"ccq_s_niah_1": {"acc": accuracy}}}))
    (unit / "samples_ccq_s_niah_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return unit


def _record(answer: str, tokenizer: str = "tiny-gla") -> dict:
    return {"doc": {"input": "haystack", "tokenizer": tokenizer}, "doc_hash": tokenizer, "resps": [[answer]]}


def test_identical_units_have_no_differences(recheck, tmp_path):
    unit = _unit(tmp_path / "committed", [_record("42"), _record("7")])
    _unit(tmp_path / "rerun", [_record("42"), _record("7")])
    assert recheck.differences({unit: {}}, tmp_path / "committed", tmp_path / "rerun") == []


def test_differences_name_the_records_and_fields(recheck, tmp_path):
    unit = _unit(tmp_path / "committed", [_record("42"), _record("7"), _record("9")])
    _unit(tmp_path / "rerun", [_record("42"), _record("8"), _record("9", tokenizer="models/tiny-gla")], accuracy=0.4)
    found = recheck.differences({unit: {}}, tmp_path / "committed", tmp_path / "rerun")
    assert found == ["tiny-gla/ccq_s_niah_1: results.json metrics differ",
                     "tiny-gla/ccq_s_niah_1/samples_ccq_s_niah_1.jsonl: 2 of 3 records differ "
                     "(first: record 1; fields: doc.tokenizer, doc_hash, resps)"]
    assert recheck.changed_fields(_record("1"), _record("1", tokenizer="other")) == {"doc.tokenizer", "doc_hash"}
