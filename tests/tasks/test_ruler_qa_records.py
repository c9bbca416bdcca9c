"""RULER QA records are checked where the data is read (data.check_squad / check_hotpotqa, through
load_qa_data): a question the prompt or the score cannot use stops its unit with one line naming the file,
the record (its place in the JSON and its id) and the field, and the unit stores nothing."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "ruler_qa"
SQUAD, HOTPOT = "dev-v2.0.json", "hotpot_dev_distractor_v1.json"

qa_data = importlib.import_module("ccq_eval.tasks.ruler_qa.data")


def write_bad(folder: Path, file_name: str, change) -> Path:
    """The fixture file after `change` (which edits the parsed JSON in place)."""
    raw = copy.deepcopy(json.loads((FIXTURES / file_name).read_text(encoding="utf-8")))
    change(raw)
    path = folder / file_name
    path.write_text(json.dumps(raw, indent=1), encoding="utf-8")
    return path


def squad_question(field, value):
    def change(raw):
        raw["data"][0]["paragraphs"][0]["qas"][1][field] = value
    return change


def hotpot_record(field, value):
    def change(raw):
        raw[1][field] = value
    return change


SQUAD_AT = "data[0].paragraphs[0].qas[1] (id fixture0002)"
HOTPOT_AT = "record 1 (_id fixture-hotpot-2)"
BAD_RECORDS = [
    (SQUAD, squad_question("question", None), SQUAD_AT, "field 'question' is null, expected a string"),
    (SQUAD, squad_question("question", {"a": 1}), SQUAD_AT, "field 'question' is {\"a\": 1}, expected a string"),
    (SQUAD, squad_question("question", " "), SQUAD_AT, "field 'question' is \" \", an empty string"),
    (SQUAD, squad_question("answers", []), SQUAD_AT, "field 'answers' is [], expected a non-empty list"),
    (SQUAD, squad_question("answers", [{"text": ""}]), SQUAD_AT, "in field 'answers', entry 0 is {\"text\": \"\"}"),
    (SQUAD, squad_question("is_impossible", "no"), SQUAD_AT, "field 'is_impossible' is \"no\", expected true"),
    (SQUAD, lambda raw: raw["data"][0]["paragraphs"][1].update(context=None), "data[0].paragraphs[1]",
     "field 'context' is null, expected a string"),
    (HOTPOT, hotpot_record("question", None), HOTPOT_AT, "field 'question' is null, expected a string"),
    (HOTPOT, hotpot_record("answer", 5), HOTPOT_AT, "field 'answer' is 5, expected a string"),
    (HOTPOT, hotpot_record("supporting_facts", [["A title"]]), HOTPOT_AT, "field 'supporting_facts' is"),
    (HOTPOT, hotpot_record("context", [["A title", [None]]]), HOTPOT_AT, "field 'context' is"),
]


@pytest.mark.parametrize("file_name, change, where, problem", BAD_RECORDS,
                         ids=[f"{f[:5]}-{p[:30]}" for f, _, _, p in BAD_RECORDS])
def test_a_bad_record_is_one_line_naming_file_record_and_field(tmp_path, file_name, change, where, problem):
    path = write_bad(tmp_path, file_name, change)
    task = "ccq_ruler_qa_squad" if file_name == SQUAD else "ccq_ruler_qa_hotpot"
    with pytest.raises(UserError) as info:
        qa_data.load_qa_data(task, tmp_path)
    message = str(info.value)
    assert message.startswith(f"{path.resolve()} {where}: {problem}"), message
    assert "; fix or remove that record" in message and "\n" not in message


def test_unanswerable_questions_are_not_checked_since_never_asked():
    raw = json.loads((FIXTURES / SQUAD).read_text(encoding="utf-8"))
    impossible = [q for a in raw["data"] for p in a["paragraphs"] for q in p["qas"] if q["is_impossible"]]
    assert impossible and all(q["answers"] == [] for q in impossible)
    qa_data.check_squad(raw, SQUAD)  # the fixture, unanswerable questions included, passes
    impossible[0]["question"] = None
    qa_data.check_squad(raw, SQUAD)
    qa_data.check_hotpotqa(json.loads((FIXTURES / HOTPOT).read_text(encoding="utf-8")), HOTPOT)


@pytest.mark.slow
def test_the_unit_fails_in_one_line_and_stores_nothing(tmp_path):
    from ccq_eval import cli

    path = write_bad(tmp_path, SQUAD, squad_question("question", None))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["run", "-m", "tiny-gla", "-t", "ccq_ruler_qa_squad", "--qa-dir",
                                          str(tmp_path), "--lengths", "1k", "--depths", "0", "-o", str(out),
                                          "--no-report"])
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert error.startswith(f"Error: {path.resolve()} {SQUAD_AT}: field 'question' is null"), error
    stored = [p.name for p in out.rglob("*") if p.name.startswith(("results", "samples", "checksums", "meta"))]
    assert not stored
