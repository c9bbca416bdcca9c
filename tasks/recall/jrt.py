"""The recall-intensive tasks' rules as the JRT harness applies them: the window cut, the prompts, the score.

    cut_window(context, anchors, tokenizer, context_length)  -> the kept text, or None (document dropped)
    build_prompt(task, doc, prompt_mode)                      -> the model input of one document
    labels_of(task, doc)                                      -> the strings whose presence scores 1
    contains_score(output, labels)                            -> 1 when any label occurs, case-insensitively

Read from HazyResearch/prefix-linear-attention at commit 7490f22bda3e38dc057bcbaffe6bdb09b4d475e6,
folder lm-eval-harness/lm_eval/: `api/task.py` (Task.truncate_context), `__main__.py` (which field is cut
and which fields anchor the window, per task), `tasks/based_*/task.py` (prompts, labels, generation
arguments, `contains_score`). The code here is written from those rules, quirks included; README.md
lists each quirk and the few places where we differ on purpose.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The papers' commands cut to 2048 tokens and leave 48 of them for the answer (MoM's and Gated DeltaNet's
# `--context_length 2048 --answer_length 48`; the JRT scripts use 50). Generation: greedy, at most 48 new
# tokens, stop at the first "\n".
ANSWER_LENGTH = 48
MAX_NEW_TOKENS = 48
STOP = "\n"
PROMPT_MODES = ("once", "twice")
# SWDE's documents end with this line and the question after it; the reference keeps what is before it.
SWDE_MARKER = "Summary of information above..."
# TriviaQA's evidence carries these structure markers, removed from the prompt.
TRIVIAQA_MARKERS = re.compile(r"\[PAR\]|\[DOC\]|\[TLE\]")


@dataclass(frozen=True)
class RecallTask:
    """One task of the table: which dataset field the window cuts (cut_field), which fields anchor the
    window (anchor_fields: the earliest case-insensitive match of any; none: the head of the document), and
    whether its labels are the `value` field (with its leading space) or the `answers` list."""

    name: str  # our lm-eval task name
    column: str  # the papers' column header
    cut_field: str
    anchor_fields: tuple[str, ...]
    labels_field: str  # "value" (one label) or "answers" (a list)


TASKS: dict[str, RecallTask] = {
    "ccq_recall_swde": RecallTask("ccq_recall_swde", "SWDE", "text", ("key", "value"), "value"),
    "ccq_recall_squad": RecallTask("ccq_recall_squad", "SQD", "text", ("value",), "value"),
    "ccq_recall_fda": RecallTask("ccq_recall_fda", "FDA", "text", ("key", "value"), "value"),
    "ccq_recall_triviaqa": RecallTask("ccq_recall_triviaqa", "TQA", "context", (), "answers"),
    "ccq_recall_nq": RecallTask("ccq_recall_nq", "NQ", "context", ("answers",), "answers"),
    "ccq_recall_drop": RecallTask("ccq_recall_drop", "DROP", "context", (), "answers"),
}


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as the reference encodes it for the cut: the tokenizer's own call, special tokens included
    (a BOS of a Llama-style tokenizer, ByT5's closing EOS), no truncation."""
    return list(tokenizer([text], truncation=False)["input_ids"][0])


def anchor_position(context: str, doc: dict[str, Any], anchor_fields: tuple[str, ...]) -> int | None:
    """The character offset the window centres on: the earliest case-insensitive literal match in `context`
    of any anchor field (a list field: its first item), else of the first `alt_answers` entry that matches;
    0 for a task without anchors; -1 when nothing matches. None when an anchor is empty or one character
    long: the reference drops such a document."""
    if not anchor_fields:
        return 0
    position = -1
    for field in anchor_fields:
        anchor = doc[field]
        if isinstance(anchor, list):
            # The reference reads anchor[0] (an empty list raises there); we drop the document instead.
            anchor = anchor[0] if anchor else ""
        if len(anchor) <= 1:
            return None
        found = re.search(re.escape(anchor), context, re.IGNORECASE)
        if found and (position == -1 or found.start() < position):
            position = found.start()
    if position < 0:
        for alternative in doc.get("alt_answers") or []:
            found = re.search(re.escape(alternative), context, re.IGNORECASE)
            if found and (position == -1 or found.start() < position):
                position = found.start()
            if position >= 0:
                break
    return position


def cut_window(context: str, doc: dict[str, Any], anchor_fields: tuple[str, ...], tokenizer: Any,
               context_length: int, answer_length: int = ANSWER_LENGTH) -> tuple[str, int, int] | None:
    """The reference's cut of one document field: (kept text, first and end token index of the window), or
    None when the document is dropped (anchor_position).

    The text is stripped and encoded whole (special tokens counted); p = the token count of the text before
    the anchor (special tokens counted too; with no match, of all but its last character, so the window sits
    at the end); the window holds D = context_length - answer_length tokens from max(0, p - D // 2), ending at
    most at the end of the text (never shifted left to fill D); it is decoded without special tokens."""
    context = context.strip()
    ids = token_ids(tokenizer, context)
    position = anchor_position(context, doc, anchor_fields)
    if position is None:
        return None
    budget = context_length - answer_length
    anchor_token = len(token_ids(tokenizer, context[:position]))  # context[:-1] when nothing matched
    if position == -1 and "tok_pos" in doc and anchor_token > budget:
        anchor_token = int(doc["tok_pos"])
    start = max(0, anchor_token - budget // 2)
    end = min(len(ids), anchor_token + budget - (anchor_token - start))
    return tokenizer.decode(ids[start:end], skip_special_tokens=True), start, end


def _drop_trailing_question(text: str, question: str) -> str:
    """`text` without every repetition of `question` at its end (case-insensitive), as the prompts do."""
    while text.lower().endswith(question.lower()):
        text = text[: -len(question)]
    return text


def _capitalised(key: str) -> str:
    return key[0].upper() + key[1:]


def _swde_text(doc: dict[str, Any]) -> str:
    text = doc["text"]
    while SWDE_MARKER in text:
        text = text.split(SWDE_MARKER)[0]
    return _drop_trailing_question(text, doc["key"] + ":")


def _extraction_prompt(task: str, doc: dict[str, Any], mode: str) -> str:
    """SWDE and FDA: the document, a period, then the capitalised key and a colon for the model to fill."""
    question = _capitalised(doc["key"]) + ":"
    if task == "ccq_recall_swde":
        text = _swde_text(doc)
        body = (text.strip("\n").strip().strip("\n").strip().strip(".") + "." if mode == "once"
                else text.strip("\n").strip(".").strip().strip("\n").strip())
    else:
        body = _drop_trailing_question(doc["text"], doc["key"] + ":").strip("\n").strip(".")
    if mode == "once":
        return (body if body.endswith(".") else body + ".") + " " + question
    if not body.endswith("."):
        body += "."
    return f"Information about {question.strip(':')}. " + body + "\n" + body + " " + question


def _qa_prompt(task: str, doc: dict[str, Any], mode: str) -> str:
    """TriviaQA, NQ and DROP: the passage without a trailing copy of the question, then the question."""
    context = doc["context"].strip()
    if task == "ccq_recall_triviaqa":
        context = TRIVIAQA_MARKERS.sub("", context)
    question = doc["question"].strip()
    if mode == "once":
        if task == "ccq_recall_nq":  # the reference's NQ removes one exact copy only
            context = context[: -len(question)] if context.endswith(question) else context
        else:
            context = _drop_trailing_question(context, question)
        return context.strip().strip(".") + ". " + question
    context = _drop_trailing_question(context, question)
    body = context.strip().strip(".").strip() + "."
    body += "\n" + body + " " + question
    if task == "ccq_recall_triviaqa":
        return doc["orig_question"] + " " + body
    return doc["orig_question"].strip(":") + " " + body


def build_prompt(task: str, doc: dict[str, Any], mode: str = "once") -> str:
    """The model input for `doc` (its cut field already cut) under prompt `mode`: "once", the reference's
    based_<task> prompt, or "twice", its based_<task>_twice prompt (JRT: the document read twice)."""
    if mode not in PROMPT_MODES:
        raise ValueError(f"prompt mode {mode!r}: valid modes are {', '.join(PROMPT_MODES)}")
    if task in ("ccq_recall_swde", "ccq_recall_fda"):
        return _extraction_prompt(task, doc, mode)
    if task == "ccq_recall_squad":
        if mode == "once":
            return doc["text"].strip()
        # The reference repeats the dataset's `context` field, which is not cut, before the cut text.
        return doc["question"] + " " + doc["context"].split("Question:")[0] + "\n" + doc["text"].strip()
    return _qa_prompt(task, doc, mode)


def labels_of(task: str, doc: dict[str, Any]) -> list[str]:
    """The labels of `doc`: SWDE / FDA / SQuAD its raw `value` (leading space kept), the others `answers`."""
    if TASKS[task].labels_field == "value":
        return [doc["value"]]
    return list(doc["answers"])


def contains_score(output: str, labels: list[str]) -> int:
    """1 when any label occurs in `output` as a literal, case-insensitive substring, else 0; the output is
    scored as generated (not stripped)."""
    return max(int(re.search(re.escape(label), output, re.IGNORECASE) is not None) for label in labels)
