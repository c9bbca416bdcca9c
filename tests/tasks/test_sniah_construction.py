"""S-NIAH prompts against an independent re-statement of RULER's niah construction, token
budgets for two tokenizers, the grid, determinism and bad settings."""

from __future__ import annotations

import functools
import importlib
import re
import uuid
from pathlib import Path

import pytest
import transformers

ROOT = Path(__file__).resolve().parents[2]
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"


sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")

# ------------------------------------------------------------------ RULER, restated
# From NVIDIA RULER scripts/data/synthetic/constants.py (TASKS['niah']) and niah.py.
RULER_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
RULER_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
RULER_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
RULER_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@functools.lru_cache(maxsize=4)
def ruler_words(haystack_text: str) -> list[str]:
    # RULER: haystack = re.sub(r'\s+', " ", essay).split(" ")
    return re.sub(r"\s+", " ", haystack_text).strip().split(" ")


def ruler_prompt(haystack_type: str, haystack_text: str, n: int, depth: float, key: str, value: str,
                 type_needle_v: str) -> str:
    """RULER's generate_input_output for one needle at a given depth (RULER draws the depth or the
    line at random; here it is given), with prepare.py's template + answer_prefix."""
    needle = RULER_NEEDLE.format(type_needle_v=type_needle_v, key=key, value=value)
    if haystack_type == "essay":
        words = ruler_words(haystack_text)
        text = " ".join((words * (n // len(words) + 1))[:n])
        sents = sn.split_sentences(text.strip())  # stands in for nltk.sent_tokenize
        positions = [0, int(len(sents) * (depth / 100)), len(sents)]
        parts = []
        for i in range(1, len(positions)):
            parts.append(" ".join(sents[positions[i - 1] : positions[i]]))
            if i - 1 < 1:
                parts.append(needle)
        context = " ".join(parts)
    else:
        sentences = [RULER_NOISE] * n
        sentences.insert(int(n * (depth / 100)), needle)
        context = "\n".join(sentences)
    template = RULER_TEMPLATE + RULER_ANSWER_PREFIX
    # single needle, single query: RULER's singular rewrite
    template = template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
    return template.format(type_needle_v=type_needle_v[:-1], context=context, query=key)


# ------------------------------------------------------------------ tokenizers
TOKENIZERS = {"byt5": "byt5", "mistral_v1": str(MISTRAL_DIR)}


def independent_count(tokenizer_name: str, tokenizer, prompt: str) -> int:
    """Prompt tokens as the model sees them, computed without the task code: UTF-8 bytes for the
    byte-level tokenizer (no BOS); for Mistral the tokenizer's own encoding with BOS."""
    if tokenizer_name == "byt5":
        return len(prompt.encode("utf-8"))
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    return len(ids)


@pytest.fixture(scope="module")
def tokenizers():
    return {name: sn.load_tokenizer(spec) for name, spec in TOKENIZERS.items()}


@pytest.fixture(scope="module")
def sotu_haystack_text():
    from ccq_eval.data.corpora import load_corpus

    return "\n\n".join(doc.text for doc in load_corpus("sotu", split="eval"))


GRID = {"lengths": [1024, 2048], "depths": [0, 33, 50, 100], "samples_per_cell": 1}


@pytest.fixture(scope="module")
def generated():
    return {
        (tok, task): sn.generate_docs(task, tokenizer=spec, **GRID)
        for tok, spec in TOKENIZERS.items()
        for task in ("s_niah_1", "s_niah_2", "s_niah_3")
    }


def test_mistral_fixture_matches_sentencepiece_ids(tokenizers):
    # ids recorded from sentencepiece 0.2.3 on tokenizer.model (see the fixture's README)
    tok = tokenizers["mistral_v1"]
    assert len(tok) == 32000
    assert tok("Hello world. The grass is green.")["input_ids"] == [1, 22557, 1526, 28723, 415, 10109, 349, 5344, 28723]
    assert tok.encode("One of the special magic numbers for quiet-harbor is: 4817263.", add_special_tokens=False) == [
        2387, 302, 272, 2841, 9693, 5551, 354, 5883, 28733, 10327, 3622, 349, 28747, 28705, 28781, 28783, 28740,
        28787, 28750, 28784, 28770, 28723,
    ]


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("task", ["s_niah_1", "s_niah_2", "s_niah_3"])
def test_prompts_equal_ruler_construction_and_fill_the_length(generated, tokenizers, sotu_haystack_text, tok_name,
                                                              task):
    haystack_type, kinds = {"s_niah_1": ("noise", "numbers"), "s_niah_2": ("essay", "numbers"),
                            "s_niah_3": ("essay", "uuids")}[task]
    tokenizer = tokenizers[tok_name]
    docs = generated[(tok_name, task)]
    assert [(d["length"], d["depth"]) for d in docs] == [(n, d) for n in GRID["lengths"] for d in GRID["depths"]]
    for doc in docs:
        n, length = doc["num_haystack"], doc["length"]
        expected = ruler_prompt(haystack_type, sotu_haystack_text, n, doc["depth"], doc["key"], doc["value"], kinds)
        assert doc["input"] == expected
        assert doc["outputs"] == [doc["value"]]
        # fits: prompt + 128 generated tokens <= nominal length ...
        tokens = independent_count(tok_name, tokenizer, doc["input"])
        assert tokens == doc["prompt_tokens"]
        assert tokens + 128 <= length
        # ... and one more haystack unit would not fit (filled to within one unit)
        bigger = ruler_prompt(haystack_type, sotu_haystack_text, n + 1, doc["depth"], doc["key"], doc["value"],
                              kinds)
        assert independent_count(tok_name, tokenizer, bigger) + 128 > length
        # the question and the answer prefix are about the needle's key
        assert doc["input"].endswith(
            f"What is the special magic {kinds[:-1]} for {doc['key']} mentioned in the provided text? "
            f"The special magic {kinds[:-1]} for {doc['key']} mentioned in the provided text is"
        )
        assert doc["input"].count(doc["value"]) == 1


def test_needle_sits_at_a_sentence_boundary_near_its_depth(generated):
    for (tok_name, task), docs in generated.items():
        for doc in docs:
            prompt = doc["input"]
            context = prompt[prompt.index("afterwards.\n") + len("afterwards.\n") : prompt.rindex("\nWhat is")]
            needle_at = context.index("One of the special magic")
            before = context[:needle_at]
            if task == "s_niah_1":
                assert before == "" or before.endswith("again.\n")
            else:
                # after a sentence end, or after the (cut) last sentence at the very end of the haystack
                at_end = context.endswith(f"{doc['value']}. ")
                assert before in ("", " ") or at_end or re.search(r"[.!?][\"')\]\u201d\u2019]* $", before), before[-40:]
            # the needle goes between whole units (lines / sentences): allow 1.5 units of slack
            units = doc["num_haystack"] if task == "s_niah_1" else len(sn.split_sentences(context.strip()))
            assert abs(needle_at / len(context) - doc["depth"] / 100) <= 1.5 / units + 0.05, (tok_name, task, doc)


def test_keys_and_values_have_ruler_forms(generated):
    keys = set(sn.load_key_words())
    assert len(keys) > 20000 and all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in keys)
    for (_, task), docs in generated.items():
        for doc in docs:
            assert doc["key"] in keys
            if task == "s_niah_3":
                assert uuid.UUID(doc["value"]).version == 4 and str(uuid.UUID(doc["value"])) == doc["value"]
                assert f"One of the special magic uuids for {doc['key']} is: {doc['value']}." in doc["input"]
            else:
                assert re.fullmatch(r"[1-9]\d{6}", doc["value"])
                assert f"One of the special magic numbers for {doc['key']} is: {doc['value']}." in doc["input"]
    for tok_name in TOKENIZERS:
        values = [doc["value"] for (tok, _), docs in generated.items() if tok == tok_name for doc in docs]
        assert len(set(values)) == len(values)  # drawn per cell, not repeated
    # the needle of a cell does not depend on the tokenizer (only the haystack size does)
    for task in ("s_niah_1", "s_niah_2", "s_niah_3"):
        assert [(d["key"], d["value"]) for d in generated[("byt5", task)]] == [
            (d["key"], d["value"]) for d in generated[("mistral_v1", task)]
        ]


def test_generation_is_deterministic_and_seeded():
    kwargs = {"tokenizer": "byt5", "lengths": [1024], "depths": [10, 90], "samples_per_cell": 2}
    first = sn.generate_docs("s_niah_3", **kwargs)
    assert first == sn.generate_docs("s_niah_3", **kwargs)
    other = sn.generate_docs("s_niah_3", seed=7, **kwargs)
    assert [d["value"] for d in other] != [d["value"] for d in first]
    # a cell's needle does not depend on which other cells are in the grid
    alone = sn.generate_docs("s_niah_3", tokenizer="byt5", lengths=[1024], depths=[90], samples_per_cell=1)
    assert alone[0]["input"] == first[2]["input"]


def test_default_grid():
    assert sn.DEFAULT_DEPTHS == (0, 11, 22, 33, 44, 56, 67, 78, 89, 100)
    grid = sn.parse_grid({"tokenizer": "byt5"})
    assert grid["lengths"] == [1024, 2048, 4096, 8192] and grid["samples_per_cell"] == 1 and grid["seed"] == 42
    assert sn.parse_grid({"pretrained": "some/model", "max_seq_lengths": "4096,1024"})["lengths"] == [1024, 4096]


def test_too_small_length_names_the_minimum():
    too_small = r"length 256 is too small for ccq_s_niah_2.*minimum length is (\d+)"
    with pytest.raises(sn.SNiahError, match=too_small) as err:
        sn.generate_docs("s_niah_2", tokenizer="byt5", lengths=[256], depths=[50])
    minimum = int(re.search(r"minimum length is (\d+)", str(err.value)).group(1))
    # the stated minimum is exact for that sample: one haystack word fits it, and one token less does not
    rng = sn.cell_rng(42, "s_niah_2", 256, 50, 0)
    key = rng.choice(sn.load_key_words())
    value = sn.draw_value(rng, "numbers")
    haystack = sn.essay_haystack("sotu")
    tok = sn.load_tokenizer("byt5")
    sample = sn.make_sample(haystack, tok, length=minimum, depth=50, key=key, value=value, kinds="numbers", guess=5)
    assert sample.num_haystack == 1 and sample.prompt_tokens + 128 == minimum
    with pytest.raises(sn.SNiahError, match=f"minimum length is {minimum}"):
        sn.make_sample(haystack, tok, length=minimum - 1, depth=50, key=key, value=value, kinds="numbers", guess=5)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({}, "pass metadata tokenizer="),
        ({"tokenizer": "byt5", "lengths": [3000]}, r"lengths \[3000\] have no per-length metric"),
        ({"tokenizer": "byt5", "depths": [50, 101]}, "each depth is a percentage in"),
        ({"tokenizer": "byt5", "depths": "middle"}, "expected numbers in"),
        ({"tokenizer": "byt5", "samples_per_cell": 0}, "one integer >= 1"),
        ({"tokenizer": "byt5", "lengths": "lots"}, "expected integers"),
    ],
)
def test_bad_metadata_is_rejected(metadata, message):
    with pytest.raises(sn.SNiahError, match=message):
        sn.parse_grid(metadata)


def test_unloadable_tokenizer_and_haystack_are_explained(tmp_path):
    with pytest.raises(sn.SNiahError, match="could not load tokenizer"):
        sn.load_tokenizer(str(tmp_path / "no_such_tokenizer"))
    with pytest.raises(sn.SNiahError, match=r"haystack: .*neither an embedded corpus"):
        sn.generate_docs("s_niah_2", tokenizer="byt5", lengths=[1024], depths=[0], haystack="pg_essays")


def test_user_haystack_file(tmp_path):
    path = tmp_path / "essays.txt"
    path.write_text(" ".join(f"Sentence number {i} is here." for i in range(400)), encoding="utf-8")
    (doc,) = sn.generate_docs("s_niah_2", tokenizer="byt5", lengths=[1024], depths=[50], haystack=str(path))
    assert doc["haystack"] == str(path) and "Sentence number 0 is here." in doc["input"]
    assert doc["input"] == ruler_prompt("essay", path.read_text(), doc["num_haystack"], 50, doc["key"], doc["value"],
                                        "numbers")


def test_haystack_repeats_when_the_text_runs_out(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Short text. Only two sentences.", encoding="utf-8")
    (doc,) = sn.generate_docs("s_niah_2", tokenizer="byt5", lengths=[1024], depths=[50], haystack=str(path))
    assert doc["input"].count("Short text.") > 10
    assert doc["input"] == ruler_prompt("essay", path.read_text(), doc["num_haystack"], 50, doc["key"], doc["value"],
                                        "numbers")


def test_sentence_splitter():
    text = ("Mr. Smith went to Washington D.C. in 1990. He met Dr. Jones! Did they talk? \"Yes.\" They did, "
            "e.g. about the U.S. Army. J. Doe agreed. 3 people came.")
    assert sn.split_sentences(text) == [
        "Mr. Smith went to Washington D.C. in 1990.",
        "He met Dr. Jones!",
        "Did they talk?",
        "\"Yes.\"",
        "They did, e.g. about the U.S. Army.",
        "J. Doe agreed.",
        "3 people came.",
    ]
    assert " ".join(sn.split_sentences(text)) == text


def test_fit_haystack_invariant_on_a_non_monotone_count():
    # count jumps around but the result must still fit, with the next unit over the target
    counts = {n: 10 * n + (7 if n % 3 == 0 else 0) for n in range(1, 400)}
    for guess in (1, 5, 50, 300):
        n = sn.fit_haystack(counts.__getitem__, 1000, guess)
        assert counts[n] <= 1000 < counts[n + 1]
    with pytest.raises(ValueError):
        sn.fit_haystack(counts.__getitem__, 5, 10)


def test_byt5_tokenizer_is_the_transformers_one():
    assert isinstance(sn.load_tokenizer("byt5"), transformers.ByT5Tokenizer)
