"""NIAH prompts for `inspect`: the needle's offset comes from the construction, and its token span
(and its value's) decodes to exactly the needle, for a byte-level and a fast subword tokenizer; on the
distractor tasks the distractor spans decode to the needles under the other keys."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ccq_eval.harness.run_options import DEFAULT_SEED
from ccq_eval.inspection import InspectError
from ccq_eval.inspection.prompts import needle_prompts, task_utils

ROOT = Path(__file__).resolve().parents[2]
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"


@pytest.mark.parametrize("variant", ["s_niah_1", "s_niah_2"])
def test_needle_offset_is_where_the_construction_put_it(variant):
    sn = task_utils("s_niah_1")
    _, kinds = sn.VARIANTS[variant]
    for doc in sn.generate_docs(variant, tokenizer="byt5", lengths=[1024], depths=[0, 50, 100]):
        needle = sn.NEEDLE.format(kinds=kinds, key=doc["key"], value=doc["value"])
        start = doc["needle_char_offset"]
        assert doc["input"][start : start + len(needle)] == needle
        assert doc["input"].count(needle) == 1


@pytest.mark.parametrize("tokenizer", ["byt5", str(MISTRAL_DIR)])
def test_token_spans_decode_to_the_needle_and_its_value(tokenizer):
    sn = task_utils("s_niah_2")
    tok = sn.load_tokenizer(tokenizer)
    prompts = needle_prompts("s-niah-2", tokenizer, [1024], [0, 50, 100])
    assert [p.depth for p in prompts] == [0, 50, 100]
    for prompt in prompts:
        needle = tok.decode(prompt.input_ids[prompt.needle[0] : prompt.needle[1]])
        value = tok.decode(prompt.input_ids[prompt.value[0] : prompt.value[1]])
        assert needle.strip().startswith("One of the special magic numbers for ") and needle.strip().endswith(".")
        assert value.strip().isdigit() and len(value.strip()) == 7 and value.strip() in needle
        assert prompt.needle[0] <= prompt.value[0] < prompt.value[1] <= prompt.needle[1] <= prompt.answer_position
        if tok.bos_token_id is not None:
            assert prompt.input_ids[0] == tok.bos_token_id
        assert len(prompt.input_ids) <= 1024 - 128


def test_unknown_task_is_named():
    with pytest.raises(InspectError, match="choose one of s-niah-1, s-niah-2, s-niah-3, niah-multikey-1"):
        needle_prompts("ppl", "byt5", [1024], [50])


@pytest.mark.parametrize("task", ["niah-multikey-1", "niah-multikey-2", "niah-multikey-3"])
@pytest.mark.parametrize("tokenizer", ["byt5", str(MISTRAL_DIR)])
def test_distractor_spans_decode_to_the_other_keys_needles(task, tokenizer):
    tok = task_utils("s_niah_1").load_tokenizer(tokenizer)
    prompts = needle_prompts(task, tokenizer, [1024], [0, 50, 100])
    docs = task_utils(task.replace("-", "_")).generate_docs(task.replace("-", "_"), tokenizer=tokenizer,
                                                            lengths=[1024], depths=[0, 50, 100],
                                                            seed=DEFAULT_SEED)  # inspect's default is run's
    for prompt, doc in zip(prompts, docs, strict=True):
        assert len(prompt.distractors) == len(doc["distractor_char_offsets"]) >= 1
        target = tok.decode(prompt.input_ids[slice(*prompt.needle)]).strip()
        assert f" for {doc['key']} is: {doc['value']}." in target
        spans = sorted([prompt.needle, *prompt.distractors])
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "needle spans overlap"
        for span in prompt.distractors:
            text = tok.decode(prompt.input_ids[slice(*span)]).strip()
            assert text.startswith("One of the special magic ") and text.endswith(".")
            assert f" for {doc['key']} is:" not in text  # a distractor never carries the asked key
