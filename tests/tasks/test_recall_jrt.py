"""The recall tasks under the jrt protocol against the JRT harness's rules, restated here from
HazyResearch/prefix-linear-attention at 7490f22 (lm-eval-harness/lm_eval/api/task.py truncate_context,
__main__.py's per-task context and answer keys, tasks/based_*/task.py): for every task and fixture document,
the window in a byte-level and a SentencePiece tokenizer, the prompt (read once and twice), the stops and the
score, compared byte for byte; plus hand-counted windows, the dropped documents and the one-line data errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers
import yaml
from ccq_eval.tasks.recall import data as recall_data
from ccq_eval.tasks.recall import jrt
from ccq_eval.tasks.recall.utils import build_docs

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "recall"
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"
TASKS = tuple(jrt.TASKS)


@pytest.fixture(scope="module")
def tokenizers():
    return {"byt5": transformers.ByT5Tokenizer(), "mistral_v1": transformers.AutoTokenizer.from_pretrained(
        str(MISTRAL_DIR), local_files_only=True)}


# ------------------------------------------------------------------ the reference, restated
# __main__.py: which field is cut and which fields anchor the window (SWDE / FDA take launch_jrt.py's
# --context_key text and the default answer keys).
REFERENCE_KEYS = {
    "ccq_recall_squad": ("text", ["value"]), "ccq_recall_drop": ("context", []),
    "ccq_recall_nq": ("context", ["answers"]), "ccq_recall_triviaqa": ("context", []),
    "ccq_recall_swde": ("text", ["key", "value"]), "ccq_recall_fda": ("text", ["key", "value"]),
}


def reference_truncate(doc, tokenizer, context_key, answer_key, context_length, answer_length=48):
    """Task.truncate_context, step by step; None where it returns no instance."""
    desired_length = context_length - answer_length
    context = doc[context_key].strip()
    doc_tokens = tokenizer([context])["input_ids"][0]
    answer_pos = -1
    for key in answer_key:
        answer = doc[key]
        if type(answer) is list:
            answer = answer[0]
        if answer == "" or len(answer) <= 1:
            return None
        match = re.compile(re.escape(answer), re.IGNORECASE).search(context)
        if match and (answer_pos == -1 or answer_pos > match.start()):
            answer_pos = match.start()
    if len(answer_key) == 0:
        answer_pos = 0
    answer_tok_pos = len(tokenizer([context[:answer_pos]])["input_ids"][0])
    half_length = desired_length // 2
    start = max(0, answer_tok_pos - half_length)
    remaining_length = desired_length - (answer_tok_pos - start)
    end = min(len(doc_tokens), answer_tok_pos + remaining_length)
    short = dict(doc)
    short[context_key] = tokenizer.decode(doc_tokens[start:end], skip_special_tokens=True)
    return short


def reference_prompt(task, doc, twice):
    """The based_<task>(_twice) classes' doc_to_text on a copy of the document."""
    doc = dict(doc)
    if task in ("ccq_recall_swde", "ccq_recall_fda"):
        question = doc["key"] + ":"
        while doc["text"].lower().endswith(question.lower()):
            doc["text"] = doc["text"][:-len(question)]
        question = doc["key"][0].upper() + doc["key"][1:] + ":"
        if task == "ccq_recall_swde" and not twice:
            return doc["text"].strip("\n").strip().strip("\n").strip().strip(".") + "." + " " + question
        if task == "ccq_recall_swde":
            out = doc["text"].strip("\n").strip(".").strip().strip("\n").strip()
        else:
            out = doc["text"].strip("\n").strip(".")
        if not out.endswith("."):
            out += "."
        if not twice:
            return out + " " + question
        return f"Information about {question.strip(':')}. " + out + "\n" + out + " " + question
    if task == "ccq_recall_squad":
        if not twice:
            return doc["text"].strip()
        return doc["question"] + " " + doc["context"].split("Question:")[0] + "\n" + doc["text"].strip()
    context = doc["context"].strip()
    if task == "ccq_recall_triviaqa":
        context = re.sub(r"\[PAR\]|\[DOC\]|\[TLE\]", "", context)
    question = doc["question"].strip()
    if task == "ccq_recall_nq" and not twice:
        if context.endswith(question):
            context = context[:-len(question)]
        return context.strip().strip(".") + ". " + doc["question"].strip()
    while context.lower().endswith(question.lower()):
        context = context[:-len(question)]
    if not twice:
        return context.strip().strip(".") + ". " + question
    out = context.strip().strip(".").strip() + "."
    out += "\n" + out + " " + question
    if task == "ccq_recall_triviaqa":
        return doc["orig_question"] + " " + out
    return doc["orig_question"].strip(":") + " " + out


def reference_labels(task, doc):
    return [doc["value"]] if task in ("ccq_recall_swde", "ccq_recall_fda", "ccq_recall_squad") else doc["answers"]


def reference_contains(prediction, labels):
    return max(int(bool(re.search(re.compile(re.escape(label), re.IGNORECASE), prediction))) for label in labels)


def fixture_rows(task):
    dataset = recall_data.dataset_for(task, 2048)
    return [json.loads(line) for line in (FIXTURES / dataset.file_name).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------ byte for byte
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("tokenizer_name", ["byt5", "mistral_v1"])
@pytest.mark.parametrize("context_length", [96, 112, 160, 2048])
def test_documents_match_the_reference_byte_for_byte(tokenizers, task, tokenizer_name, context_length):
    tokenizer = tokenizers[tokenizer_name]
    rows = fixture_rows(task)
    context_key, answer_key = REFERENCE_KEYS[task]
    for mode in jrt.PROMPT_MODES:
        expected = []
        for row in rows:
            row = dict(row)
            if task == "ccq_recall_swde":  # SWDE's validation_docs: the text before the summary line
                row["text"], _ = row["text"].split("Summary of information above...")
            short = reference_truncate(row, tokenizer, context_key, answer_key, context_length)
            if short is not None:
                expected.append((reference_prompt(task, short, mode == "twice"), reference_labels(task, short)))
        got = build_docs(task, rows, tokenizer, context_length, mode)
        assert [(doc["prompt"], doc["labels"]) for doc in got] == expected, (task, tokenizer_name, mode)


def test_the_short_lengths_do_cut(tokenizers):
    """The fixtures are long enough for the parametrised lengths above to cut them (else that test would
    compare whole documents only)."""
    for tokenizer in tokenizers.values():
        docs = build_docs("ccq_recall_swde", fixture_rows("ccq_recall_swde"), tokenizer, 112, "once")
        assert all(doc["window"][1] - doc["window"][0] == 64 for doc in docs)
        assert all(len(doc["text"]) < len(row["text"]) for doc, row in zip(docs, fixture_rows("ccq_recall_swde")))


def test_byte_level_window_counted_by_hand(tokenizers):
    """ByT5 ends every encoding with EOS, so the anchor's token index is its byte offset + 1; a window of
    112 - 48 = 64 tokens starts 32 before it and is decoded without the EOS."""
    row = fixture_rows("ccq_recall_swde")[0]
    text = row["text"].split(jrt.SWDE_MARKER)[0].strip()
    anchor = text.lower().index("director")  # "Director: Chris Columbus": the key matches before the value
    (doc,) = build_docs("ccq_recall_swde", [row], tokenizers["byt5"], 112, "once")
    assert doc["window"] == [anchor + 1 - 32, anchor + 1 + 32]
    assert doc["prompt"] == text[anchor - 31 : anchor + 33].strip("\n").strip().strip(".") + ". Director:"
    # No anchor (TriviaQA): the head of the document, 64 bytes of it.
    tqa = fixture_rows("ccq_recall_triviaqa")[0]
    (doc,) = build_docs("ccq_recall_triviaqa", [tqa], tokenizers["byt5"], 112, "once")
    assert doc["window"] == [0, 64]
    assert doc["context"] == tqa["context"].strip()[:64]


def test_no_match_puts_the_window_at_the_end(tokenizers):
    """A label absent from the document: the reference counts the tokens of all but the last character, so
    the window ends at the document's end and holds only half of D (no shift to the left)."""
    row = {"context": "x" * 300, "question": "q?", "answers": ["absent"], "orig_question": "q?"}
    (doc,) = build_docs("ccq_recall_nq", [row], tokenizers["byt5"], 112, "once")
    assert doc["window"] == [300 - 32, 301]  # 300 bytes + EOS
    assert doc["context"] == "x" * 32


def test_short_anchors_drop_the_document_as_the_reference_does(tokenizers):
    rows = fixture_rows("ccq_recall_fda")
    docs = build_docs("ccq_recall_fda", rows, tokenizers["byt5"], 2048, "once")
    assert [doc["row"] for doc in docs] == [i for i, row in enumerate(rows) if len(row["value"]) > 1]
    assert len(docs) == len(rows) - 1


def test_generation_arguments_and_score():
    """Greedy, at most 48 new tokens, stop at "\\n"; the output is scored as generated: a label keeps its
    leading space, the match ignores case, any label scores 1."""
    template = yaml.safe_load((ROOT / "tasks" / "recall" / "_recall_template_yaml").read_text().replace("!function",
                                                                                                         ""))
    assert template["generation_kwargs"] == {"until": ["\n"], "do_sample": False, "temperature": 0.0,
                                             "max_gen_toks": jrt.MAX_NEW_TOKENS}
    assert jrt.MAX_NEW_TOKENS == 48 and jrt.STOP == "\n"
    cases = [(" chris columbus, 2001", [" Chris Columbus"]), ("Chris Columbus", [" Chris Columbus"]),
             (" The Eagles", ["Eagles", "the Eagles"]), ("", ["x"]), (" a.b", ["a.b"]), (" axb", ["a.b"])]
    for output, labels in cases:
        assert jrt.contains_score(output, labels) == reference_contains(output, labels), (output, labels)
    assert [jrt.contains_score(o, labels) for o, labels in cases] == [1, 0, 1, 0, 1, 0]


# ------------------------------------------------------------------ data errors
def test_a_bad_row_is_one_line_naming_file_line_and_field(tmp_path):
    folder = tmp_path / "swde"
    folder.mkdir()
    good = fixture_rows("ccq_recall_swde")[0]
    bad = dict(good, key="")
    (folder / "validation.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(recall_data.RecallDataError) as raised:
        recall_data.load_rows("ccq_recall_swde", 2048, tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{folder / 'validation.jsonl'} line 2: field 'key' is \"\", expected a non-empty")
    assert "\n" not in message
    (folder / "validation.jsonl").write_text(json.dumps(dict(good, text="no marker")) + "\n")
    with pytest.raises(recall_data.RecallDataError, match="line 1: field 'text' holds 0 copies"):
        recall_data.load_rows("ccq_recall_swde", 2048, tmp_path)


def test_twice_needs_the_original_question(tmp_path):
    row = fixture_rows("ccq_recall_drop")[0]
    del row["orig_question"]
    (tmp_path / "drop").mkdir()
    (tmp_path / "drop" / "validation.jsonl").write_text(json.dumps(row) + "\n")
    assert recall_data.load_rows("ccq_recall_drop", 2048, tmp_path, "once")
    with pytest.raises(recall_data.RecallDataError, match="field 'orig_question' is missing"):
        recall_data.load_rows("ccq_recall_drop", 2048, tmp_path, "twice")


def test_nq_reads_the_dataset_of_its_length():
    assert recall_data.dataset_for("ccq_recall_nq", 512).hub_id == "hazyresearch/based_nq_512"
    assert recall_data.dataset_for("ccq_recall_nq", None).folder == "nq_2048"
    with pytest.raises(recall_data.RecallDataError, match="--recall-length 3000 has no NQ dataset"):
        recall_data.dataset_for("ccq_recall_nq", 3000)
