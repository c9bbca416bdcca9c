"""Zero-shot data from --zeroshot-dir is checked row by row before lm-eval reads it (zeroshot.check_rows,
through task_specs): a row whose fields the task's config cannot score as it means to (a null text, a
label out of range or of another type, a missing field) stops its unit with one line naming the file, the
line and the field, and the unit stores nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.harness import zeroshot
from ccq_eval.harness.zeroshot import ZeroshotDataError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zeroshot"


def split_file(task: str) -> Path:
    (path,) = sorted((FIXTURES / task).glob("*.jsonl"))
    return path


def write_bad(folder: Path, task: str, change) -> Path:
    """A copy of the fixtures in `folder` where `task`'s second row went through `change` (dict -> JSON value)."""
    shutil.copytree(FIXTURES / task, folder / task)
    path = folder / task / split_file(task).name
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[1] = json.dumps(change(json.loads(lines[1])))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def set_(name, value):
    return lambda row: row | {name: value}


def drop(name):
    return lambda row: {key: value for key, value in row.items() if key != name}


BAD_ROWS = [
    ("piqa", set_("label", None), "field 'label' is null, expected one of 0, 1"),
    ("piqa", set_("label", 2), "field 'label' is 2, expected one of 0, 1"),
    ("piqa", set_("label", "1"), "field 'label' is \"1\", expected one of 0, 1"),
    ("piqa", drop("label"), "field 'label' is missing"),
    ("piqa", set_("goal", None), "field 'goal' is null, expected a string"),
    ("copa", set_("label", 5), "field 'label' is 5, expected one of 0, 1"),
    ("copa", set_("question", "why"), "field 'question' is \"why\", expected one of \"cause\", \"effect\""),
    ("copa", set_("choice1", ""), "field 'choice1' is \"\", expected a non-empty string"),
    ("boolq", set_("label", True), "field 'label' is true, expected one of 0, 1"),
    ("boolq", set_("passage", {"a": 1}), "field 'passage' is {\"a\": 1}, expected a string"),
    ("hellaswag", set_("label", "4"), "field 'label' is \"4\", expected the index of the right ending, 0 to 3"),
    ("hellaswag", set_("endings", []), "field 'endings' is [], expected a non-empty list of strings"),
    ("winogrande", set_("answer", 2), "field 'answer' is 2, expected one of \"1\", \"2\""),
    ("winogrande", set_("sentence", "no blank here"), "field 'sentence' is \"no blank here\", expected a string"),
    ("arc_easy", set_("answerKey", "E"), "field 'answerKey' is \"E\", expected one of the row's choices.label"),
    ("arc_challenge", set_("choices", {"text": ["a"], "label": ["A", "B"]}), "field 'choices' is"),
    ("openbookqa", set_("answerKey", None), "field 'answerKey' is null"),
    ("social_iqa", set_("label", "4"), "field 'label' is \"4\", expected one of \"1\", \"2\", \"3\""),
    ("social_iqa", set_("answerC", None), "field 'answerC' is null, expected a string"),
    ("sciq", set_("correct_answer", 3), "field 'correct_answer' is 3, expected a string"),
    ("lambada_openai", set_("text", None), "field 'text' is null, expected a non-empty string"),
    ("wikitext", set_("page", None), "field 'page' is null, expected a string"),
    ("piqa", lambda row: [row], "expected a JSON object"),
]


@pytest.fixture(scope="module")
def task_manager():
    from ccq_eval.harness.task_registry import make_task_manager

    return make_task_manager()


@pytest.mark.parametrize("task, change, problem", BAD_ROWS, ids=[f"{t}-{p[:30]}" for t, _, p in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_file_line_and_field(tmp_path, task_manager, task, change, problem):
    path = write_bad(tmp_path, task, change)
    with pytest.raises(ZeroshotDataError) as info:
        zeroshot.task_specs(task_manager, [task], tmp_path)
    message = str(info.value)
    assert message.startswith(f"{path} line 2: {problem}"), message
    assert "; fix or remove that row (--zeroshot-dir holds rows in " in message and "\n" not in message


def test_a_line_that_is_not_json_and_an_empty_file(tmp_path):
    (tmp_path / "piqa").mkdir()
    path = tmp_path / "piqa" / "validation.jsonl"
    path.write_text(split_file("piqa").read_text(encoding="utf-8") + '{"goal": \n', encoding="utf-8")
    with pytest.raises(ZeroshotDataError, match=rf"^{path} line 4: not valid JSON"):
        zeroshot.check_rows("piqa", path)
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ZeroshotDataError, match=rf"^{path} holds no rows"):
        zeroshot.check_rows("piqa", path)


def test_every_fixture_row_passes_and_every_suite_task_is_checked():
    assert set(zeroshot.ROW_FIELDS) == set(zeroshot.ZEROSHOT_TASKS)
    for task in zeroshot.ZEROSHOT_TASKS:
        zeroshot.check_rows(task, split_file(task))


@pytest.mark.slow
def test_the_unit_fails_in_one_line_and_stores_nothing(tmp_path):
    from ccq_eval import cli

    folder = tmp_path / "data"
    path = write_bad(folder, "piqa", set_("label", 7))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["run", "-m", "tiny-gla", "-t", "piqa", "--zeroshot-dir", str(folder),
                                          "-o", str(out), "--no-report"])
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert error.startswith(f"Error: {path} line 2: field 'label' is 7, expected one of 0, 1; fix or remove"), error
    stored = [p.name for p in out.rglob("*") if p.name.startswith(("results", "samples", "checksums", "meta"))]
    assert not stored
