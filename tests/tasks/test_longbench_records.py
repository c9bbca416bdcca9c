"""LongBench records are checked where the data is read (utils.record_problem, through load_longbench): a
record the prompt or the metric cannot use stops its unit with one line naming the file, the line and the
field, and the unit stores nothing."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"

utils = importlib.import_module("ccq_eval.tasks.longbench.utils")


def _lines(file_name: str) -> list[str]:
    return [line for line in (FIXTURES / file_name).read_text(encoding="utf-8").splitlines() if line.strip()]


def write_bad(folder: Path, file_name: str, change) -> Path:
    """The fixture file with its second record passed through `change` (a dict -> the JSON value written)."""
    lines = _lines(file_name)
    lines[1] = json.dumps(change(json.loads(lines[1])))
    path = folder / file_name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def with_field(name, value):
    return lambda record: record | {name: value}


BAD_RECORDS = [
    ("qasper.jsonl", with_field("context", None), "field 'context' is null, expected a string"),
    ("qasper.jsonl", with_field("context", 5), "field 'context' is 5, expected a string"),
    ("qasper.jsonl", with_field("context", {"a": 1}), "field 'context' is {\"a\": 1}, expected a string"),
    ("qasper.jsonl", with_field("input", ["q"]), "field 'input' is [\"q\"], expected a string"),
    ("qasper.jsonl", with_field("answers", []), "field 'answers' is an empty list"),
    ("qasper.jsonl", with_field("answers", None), "field 'answers' is null, expected a list of strings"),
    ("qasper.jsonl", with_field("answers", ["a", 3]), "field 'answers' is [\"a\", 3], expected a list of strings"),
    ("qasper.jsonl", with_field("length", "12"), "field 'length' is \"12\", expected a whole number"),
    ("qasper.jsonl", with_field("length", None), "field 'length' is null, expected a whole number"),
    ("qasper.jsonl", with_field("all_classes", "a"), "field 'all_classes' is \"a\", expected a list of strings"),
    ("qasper.jsonl", with_field("language", 1), "field 'language' is 1, expected a string or null"),
    ("qasper.jsonl", lambda record: {k: v for k, v in record.items() if k != "context"}, "record lacks context"),
    ("qasper.jsonl", lambda record: [record], "expected a JSON object"),
    ("trec.jsonl", with_field("all_classes", None), "field 'all_classes' is null: trec is scored against"),
    ("passage_retrieval_en.jsonl", with_field("answers", ["the third one"]),
     "gold answer \"the third one\" in field 'answers' names no paragraph"),
]


@pytest.mark.parametrize("file_name, change, problem", BAD_RECORDS,
                         ids=[f"{f}-{p[:30]}" for f, _, p in BAD_RECORDS])
def test_a_bad_record_is_one_line_naming_file_line_and_field(tmp_path, file_name, change, problem):
    path = write_bad(tmp_path, file_name, change)
    with pytest.raises(UserError) as info:
        utils.load_longbench(file_name.removesuffix(".jsonl"), data_dir=str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"{path} line 2: {problem}") and message.endswith("; fix or remove that record")
    assert "\n" not in message and isinstance(info.value, ValueError)


def test_a_line_that_is_not_json_names_its_line(tmp_path):
    lines = _lines("qasper.jsonl")
    (tmp_path / "qasper.jsonl").write_text(lines[0] + "\n\n" + '{"input": "x",' + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"qasper.jsonl line 3: not valid JSON"):
        utils.load_longbench("qasper", data_dir=str(tmp_path))


def test_every_fixture_record_passes(tmp_path):
    for path in sorted(FIXTURES.glob("*.jsonl")):
        dataset = path.stem.removesuffix("_e")
        for line in _lines(path.name):
            assert utils.record_problem(json.loads(line), dataset) is None, path.name


@pytest.mark.slow
def test_the_unit_fails_in_one_line_and_stores_nothing(tmp_path):
    from ccq_eval import cli

    path = write_bad(tmp_path, "qasper.jsonl", with_field("context", None))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["run", "-m", "tiny-gla", "-t", "ccq_longbench_qasper", "--longbench-dir",
                                          str(tmp_path), "-o", str(out), "--no-report"])
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert error.startswith(f"Error: {path} line 2: field 'context' is null, expected a string"), error
    assert "Traceback" not in result.output
    stored = [p.name for p in out.rglob("*") if p.name.startswith(("results", "samples", "checksums", "meta"))]
    assert not stored
