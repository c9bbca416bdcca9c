"""RULER multi-key / multi-value / multi-query NIAH (tasks/ruler_niah): prompts rebuilt by lm-eval
0.4.13's RULER port from the same needles, depths and haystack; exact fit for two tokenizers; RULER
scoring; the tasks through lm-eval's TaskManager; where the target and the distractor needles sit."""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

import nltk
import numpy as np
import pytest
from lm_eval import simple_evaluate
from lm_eval.api.utils import requires_delimiter
from lm_eval.tasks import TaskManager
from scripted_lm import ScriptedLM

from ccq_eval.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"

rn = importlib.import_module("ccq_eval.tasks.ruler_niah.utils")
cons = importlib.import_module("ccq_eval.tasks.s_niah.construction")

TASKS = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery")
TOKENIZERS = {"byt5": "byt5", "mistral_v1": str(MISTRAL_DIR)}
GRID = {"lengths": [1024, 2048], "depths": [0, 33, 50, 100], "samples_per_cell": 1}
NEEDLE_AT = re.compile(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.")


@pytest.fixture(scope="module")
def generated():
    return {(tok, task): rn.generate_docs(task, tokenizer=spec, **GRID) for tok, spec in TOKENIZERS.items()
            for task in TASKS}


@pytest.fixture(scope="module")
def essay():
    return cons.essay_haystack("sotu")


@pytest.fixture(scope="module")
def word_keys():
    return cons.load_key_words()


def test_s_niah_and_ruler_niah_share_the_construction():
    # one implementation (tasks/s_niah/construction.py), still importable from S-NIAH's hooks
    sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")
    shared = ("EssayHaystack", "NoiseHaystack", "fit_haystack", "fit_to_length", "prompt_token_count",
              "split_sentences", "load_key_words", "draw_value", "cell_rng", "parse_grid", "load_tokenizer",
              "process_results", "string_match_all", "postprocess_prediction", "NEEDLE", "METRIC_LENGTHS")
    for name in shared:
        assert getattr(sn, name) is getattr(cons, name)
    assert rn.process_results is cons.process_results and sn.SNiahError is cons.NiahError
    assert issubclass(cons.NiahError, UserError) and issubclass(cons.NiahError, ValueError)


def construction_of(doc: dict, essay, word_keys):
    """The needles and haystack of a doc, rebuilt from its cell (what the task built it from)."""
    task = doc["task"].removeprefix("ccq_")
    needles, haystack = rn.sample_construction(task, doc["seed"], doc["length"], doc["depth"], doc["sample"],
                                               word_keys, essay)
    assert needles.queries == doc["keys"] and needles.outputs == doc["outputs"]
    return needles, haystack


def prompt_with(doc: dict, needles, haystack, n: int) -> str:
    variant = rn.VARIANTS[doc["task"].removeprefix("ccq_")]
    return rn.build_prompt(variant, needles.queries, rn.layout(needles, haystack, n)[0])


# ------------------------------------------------------------------ lm-eval's RULER port
@pytest.fixture(scope="module")
def port():
    """lm_eval.tasks.ruler.niah_utils and prepare_niah, imported offline: prepare_niah imports the
    wonderwords package (not installed; its words are never used here, keys come from our draws) and
    downloads nltk's punkt at import (skipped; its sentence splitter is replaced by ours below, the
    documented stand-in, as in the S-NIAH tests)."""
    names = ("lm_eval.tasks.ruler.prepare_niah", "lm_eval.tasks.ruler.niah_utils")
    wonderwords = types.ModuleType("wonderwords")
    categories = {"nouns": [], "adjectives": [], "verbs": []}
    wonderwords.RandomWord = type("RandomWord", (), {"_categories": categories})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wonderwords", wonderwords)
        mp.setattr(nltk.data, "find", lambda resource, *args, **kwargs: resource)
        for name in names:
            mp.delitem(sys.modules, name, raising=False)
        niah_utils = importlib.import_module(names[1])
    yield types.SimpleNamespace(niah_utils=niah_utils, prepare=sys.modules[names[0]])
    for name in names:
        sys.modules.pop(name, None)


class ScriptedRandom:
    """Stands in for the `random` module inside prepare_niah for one generate_input_output call: the
    needle shuffle puts the needles in our layout order, and each random.sample returns our choice
    (needle depths or line, then the asked keys) after checking what the port samples from."""

    def __init__(self, layout_rank: dict[str, tuple], samples: list[tuple[list, list]]):
        self.layout_rank = layout_rank
        self.samples = list(samples)

    def Random(self, seed):  # the port calls random.Random(seed).shuffle(needles)
        return types.SimpleNamespace(shuffle=lambda needles: needles.sort(key=self.layout_rank.__getitem__))

    def sample(self, population, k):
        expected_population, choice = self.samples.pop(0)
        assert list(population) == list(expected_population) and k == len(choice)
        return list(choice)


def port_prompt(
    port, task: str, length: int, n: int, needles, haystack, essay_words: list[str]
) -> tuple[str, list]:
    """The prompt lm-eval's port builds (niah_utils.<task> -> generate_samples -> generate_input_output,
    then lm-eval's gen_prefix joining) with n haystack units and its random draws replaced by ours."""
    variant = rn.VARIANTS[task]
    prepare, niah_utils = port.prepare, port.niah_utils
    draws = []  # generate_random's answers in the port's order: a key, its values; then haystack needles
    for key, key_values in zip(needles.keys, needles.values):
        draws += [(variant.key_kinds, key), *((variant.value_kinds, value) for value in key_values)]
    if variant.haystack == "needle":
        for key, value in haystack.pairs(n):
            draws += [(variant.key_kinds, key), (variant.value_kinds, value)]
        where = (range(n), [int(n * needles.depths[0] / 100)])
    else:
        where = (prepare.DEPTHS, needles.depths)
    asked = (range(len(needles.keys)), list(range(needles.num_queries)))
    rank = {text: (depth, i) for i, (depth, text) in enumerate(zip(needles.depths, needles.texts))}
    assert len(rank) == len(needles.texts)
    real_generate, real_samples, real_haystack = (prepare.generate_input_output, niah_utils.generate_samples,
                                                  niah_utils.get_haystack)

    def generate(num_haystack, haystack_arg, **kwargs):
        queue = list(draws)

        def generate_random(type_needle):
            kind, value = queue.pop(0)
            assert type_needle == kind
            return value

        mp.setattr(prepare, "generate_random", generate_random)
        mp.setattr(prepare, "random", ScriptedRandom(rank, [where, asked]))
        out = real_generate(n, haystack_arg, **kwargs)
        assert not queue
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "generate_input_output", generate)
        mp.setattr(prepare, "cached_sent_tokenize", cons.split_sentences)
        mp.setattr(niah_utils, "get_tokenizer", lambda name: lambda text: types.SimpleNamespace(
            input_ids=[0] * (length - 128)))  # sizes every sample to just fit: the port keeps n
        mp.setattr(niah_utils, "get_haystack", lambda type_haystack: (
            essay_words if type_haystack == "essay" else real_haystack(type_haystack)))
        mp.setattr(niah_utils, "generate_samples", lambda *args, **kwargs: real_samples(*args, **{
            **kwargs, "num_samples": 1}))
        (row,) = getattr(niah_utils, task)(tokenizer="scripted", max_seq_lengths=[length])["test"]
    # the port's task YAML: doc_to_text {{input}}, gen_prefix {{gen_prefix}}, target_delimiter " "
    joiner = " " if requires_delimiter(row["input"], row["gen_prefix"]) else ""
    return row["input"] + joiner + row["gen_prefix"], row["outputs"]


@pytest.mark.parametrize("task", TASKS)
def test_prompts_equal_lm_eval_ruler_port(generated, port, essay, word_keys, task):
    for tok_name in TOKENIZERS:
        for doc in generated[(tok_name, task)]:
            needles, haystack = construction_of(doc, essay, word_keys)
            n = doc["num_haystack"]
            prompt, outputs = port_prompt(port, task, doc["length"], n, needles, haystack, essay.words)
            assert doc["input"] == prompt
            assert doc["outputs"] == outputs
            assert doc["input"].endswith(doc["answer_prefix"])
            if tok_name == "byt5":  # the one-unit-larger prompt of the fit test, too
                bigger = port_prompt(port, task, doc["length"], n + 1, needles, haystack, essay.words)[0]
                assert prompt_with(doc, needles, haystack, n + 1) == bigger


def test_ruler_wording(generated):
    # constants.py TASKS['niah'] and niah.py, restated: plural template for 4 values asked,
    # RULER's singular rewrite for one, the asked keys joined "a, b, c, and d"
    multiquery = generated[("byt5", "niah_multiquery")][0]
    keys = multiquery["keys"]
    assert len(keys) == 4 and len(set(keys)) == 4
    asked = f"{keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]}"
    assert multiquery["input"].startswith(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n")
    assert multiquery["input"].endswith(
        f"\nWhat are all the special magic numbers for {asked} mentioned in the provided text? "
        f"The special magic numbers for {asked} mentioned in the provided text are")
    multivalue = generated[("byt5", "niah_multivalue")][0]
    key = multivalue["key"]
    assert multivalue["input"].endswith(
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
        f"The special magic numbers for {key} mentioned in the provided text are")
    for task, kind in (("niah_multikey_1", "number"), ("niah_multikey_2", "number"),
                       ("niah_multikey_3", "uuid")):
        doc = generated[("byt5", task)][0]
        assert doc["input"].startswith(
            f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n")
        assert doc["answer_prefix"] == (
            f" The special magic {kind} for {doc['key']} mentioned in the provided text is")
    key3 = generated[("byt5", "niah_multikey_3")][0]["key"]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", key3)


# ------------------------------------------------------------------ exact fit
def independent_count(tok_name: str, tokenizer, prompt: str) -> int:
    """Prompt tokens as the model sees them, without the task code: UTF-8 bytes for ByT5 (no BOS);
    the Mistral tokenizer's own encoding with its BOS."""
    if tok_name == "byt5":
        return len(prompt.encode("utf-8"))
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    return len(ids)


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_prompts_fill_the_length_exactly(generated, essay, word_keys, tok_name):
    tokenizer = cons.load_tokenizer(TOKENIZERS[tok_name])
    for task in TASKS:
        docs = generated[(tok_name, task)]
        cells = [(n, d) for n in GRID["lengths"] for d in GRID["depths"]]
        assert [(d["length"], d["depth"]) for d in docs] == cells
        for doc in docs:
            tokens = independent_count(tok_name, tokenizer, doc["input"])
            assert tokens == doc["prompt_tokens"] and tokens + 128 <= doc["length"]
            needles, haystack = construction_of(doc, essay, word_keys)
            assert prompt_with(doc, needles, haystack, doc["num_haystack"]) == doc["input"]
            bigger = prompt_with(doc, needles, haystack, doc["num_haystack"] + 1)
            assert independent_count(tok_name, tokenizer, bigger) + 128 > doc["length"], (task, doc["depth"])


def test_too_small_length_names_the_minimum(essay, word_keys):
    too_small = r"length 512 is too small for ccq_niah_multikey_3.*minimum length is (\d+)"
    with pytest.raises(cons.NiahError, match=too_small) as err:
        rn.generate_docs("niah_multikey_3", tokenizer="byt5", lengths=[512], depths=[50])
    minimum = int(re.search(r"minimum length is (\d+)", str(err.value)).group(1))
    needles, haystack = rn.sample_construction("niah_multikey_3", 42, 512, 50, 0, word_keys, None)
    tokenizer = cons.load_tokenizer("byt5")
    variant = rn.VARIANTS["niah_multikey_3"]
    sample = rn.make_sample(variant, needles, haystack, tokenizer, length=minimum, guess=4, task="t")
    assert sample.num_haystack == 1 and sample.prompt_tokens + 128 == minimum
    with pytest.raises(cons.NiahError, match=f"minimum length is {minimum}"):
        rn.make_sample(variant, needles, haystack, tokenizer, length=minimum - 1, guess=4, task="t")


# ------------------------------------------------------------------ where the needles are
def needle_at(prompt: str, offset: int) -> tuple[str, str]:
    match = NEEDLE_AT.match(prompt, offset)
    assert match, prompt[offset : offset + 60]
    return match.group(1), match.group(2)


def test_needle_and_distractor_offsets(generated):
    for (_, task), docs in generated.items():
        variant = rn.VARIANTS[task]
        for doc in docs:
            prompt = doc["input"]
            gold = [needle_at(prompt, o) for o in doc["needle_char_offsets"]]
            asked = [key for key in doc["keys"] for _ in range(variant.num_values)]
            assert gold == list(zip(asked, doc["outputs"]))
            assert doc["needle_char_offset"] == doc["needle_char_offsets"][0]
            distractors = [needle_at(prompt, o) for o in doc["distractor_char_offsets"]]
            assert all(key not in doc["keys"] for key, _ in distractors)
            expected = {"niah_multikey_1": 3, "niah_multivalue": 0, "niah_multiquery": 0}
            assert len(distractors) == expected.get(task, doc["num_haystack"])
            # every needle of the prompt is one of those
            context = prompt[: prompt.rindex("\nWhat ")]
            every = [m.start() for m in NEEDLE_AT.finditer(context)]
            assert sorted(every) == sorted(doc["needle_char_offsets"] + doc["distractor_char_offsets"])
            assert len(set(every)) == len(every)
            if task == "niah_multikey_1":
                assert len({key for key, _ in distractors}) == 3


def words_before(prompt: str, offset: int, start: int, needle_spans: list[tuple[int, int]]) -> int:
    """Haystack words between the context start and offset, needles left out."""
    text, cut = [], start
    for a, b in sorted(needle_spans):
        if b <= offset:
            text.append(prompt[cut:a])
            cut = b
    text.append(prompt[cut:offset])
    return len(" ".join(text).split())


def test_target_needle_sits_at_the_grid_depth(generated, essay, word_keys):
    for (_, task), docs in generated.items():
        for doc in docs:
            prompt, n, depth = doc["input"], doc["num_haystack"], doc["depth"]
            start = prompt.index("afterwards.\n") + len("afterwards.\n")
            needles, _ = construction_of(doc, essay, word_keys)
            offsets = doc["needle_char_offsets"] + doc["distractor_char_offsets"]
            spans = [(o, prompt.index(".", prompt.index(" is: ", o) + 5) + 1) for o in offsets]
            if rn.VARIANTS[task].haystack == "needle":
                # the target is its own line, after int(n * depth / 100) haystack needles
                assert prompt[start : doc["needle_char_offset"]].count("\n") == int(n * depth / 100)
                assert prompt[doc["needle_char_offset"] - 1] == "\n" or doc["needle_char_offset"] == start
                continue
            # essays: each needle before sentence int(n_sentences * depth / 100); the target at the grid depth
            sentences = cons.split_sentences(" ".join(essay.words[:n]))
            assert needles.depths[0] == depth and doc["needle_depths"] == needles.depths[: needles.num_gold]
            placed = dict(zip(needles.texts, needles.depths))
            for offset, (a, b) in zip(offsets, spans):
                position = int(len(sentences) * placed[prompt[a:b]] / 100)
                expected = sum(len(s.split(" ")) for s in sentences[:position])
                assert words_before(prompt, offset, start, spans) == expected, (task, doc["depth"])


def test_other_needles_depths_are_rulers_and_differ_from_the_target(word_keys):
    # RULER's depths: round(linspace(0, 100, 40)) (niah.py DEPTHS)
    assert list(rn.RULER_DEPTHS) == [int(x) for x in np.round(np.linspace(0, 100, 40))]
    for depth in (*rn.RULER_DEPTHS, 11, 12.5):
        for index in range(10):
            rng = cons.cell_rng(1, "niah_multiquery", 1024, depth, index, family="ccq-ruler-niah")
            needles = rn.draw_needles(rn.VARIANTS["niah_multiquery"], rng, depth, word_keys)
            assert needles.depths[0] == depth and len(set(needles.depths)) == 4
            assert all(d in rn.RULER_DEPTHS for d in needles.depths[1:])


def test_needle_haystack_never_repeats_the_target_key():
    variant = rn.VARIANTS["niah_multikey_2"]
    haystack = rn.NeedleHaystack(7, variant, "quiet-harbor", ["quiet-harbor", "green-door"])
    assert {key for key, _ in haystack.pairs(50)} == {"green-door"}
    expected = [f"One of the special magic numbers for green-door is: {v}." for _, v in haystack.pairs(3)]
    assert haystack.lines(3) == expected


def test_generation_is_deterministic_and_per_cell():
    kwargs = {"tokenizer": "byt5", "lengths": [1024], "depths": [10, 90], "samples_per_cell": 2}
    first = rn.generate_docs("niah_multikey_2", **kwargs)
    assert first == rn.generate_docs("niah_multikey_2", **kwargs)
    other_seed = rn.generate_docs("niah_multikey_2", seed=7, **kwargs)
    assert [d["outputs"] for d in other_seed] != [d["outputs"] for d in first]
    # a cell's needles do not depend on which other cells are in the grid
    alone = rn.generate_docs("niah_multikey_2", tokenizer="byt5", lengths=[1024], depths=[90])
    assert alone[0]["input"] == first[2]["input"]


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({}, "RULER NIAH sizes prompts in the evaluated model's tokens: pass metadata tokenizer="),
        ({"tokenizer": "byt5", "lengths": [3000]}, r"lengths \[3000\] have no per-length metric"),
        ({"tokenizer": "byt5", "depths": [50, 101]}, "each depth is a percentage in"),
    ],
)
def test_bad_metadata_is_rejected(metadata, message):
    with pytest.raises(cons.NiahError, match=message):
        rn.generate_docs("niah_multivalue", **metadata)
    with pytest.raises(cons.NiahError, match="unknown RULER NIAH task 'niah_single_1'"):
        rn.generate_docs("niah_single_1", tokenizer="byt5")


# ------------------------------------------------------------------ scoring
@pytest.fixture(scope="module")
def ruler_scoring():
    """lm-eval's port of RULER's postprocessing and string_match_all (common_utils needs no network)."""
    return importlib.import_module("lm_eval.tasks.ruler.common_utils")


def test_scoring_is_rulers_string_match_all(generated, ruler_scoring):
    for task in TASKS:
        for doc in generated[("byt5", task)]:
            outputs, distractor_values = doc["outputs"], [
                needle_at(doc["input"], o)[1] for o in doc["distractor_char_offsets"]]
            predictions = [
                " " + ", ".join(outputs) + ".",  # all gold values
                "\n " + ", ".join(v.upper() for v in outputs),  # case-insensitive
                *(" and ".join(outputs[:k]) for k in range(1, len(outputs))),  # some of them
                " " + " ".join(distractor_values[:3]) + " 0000000",  # only other keys' values
                "",
            ]
            for prediction in predictions:
                cleaned = ruler_scoring.postprocess_pred([prediction])
                expected = 100 * ruler_scoring.string_match_all(cleaned, [outputs])
                per_length = f"acc_{doc['length']}"
                assert rn.process_results(doc, [prediction]) == {"acc": expected, per_length: expected}
            assert rn.process_results(doc, [predictions[0]])["acc"] == 100.0
            if not set(outputs) & set(distractor_values):
                assert rn.process_results(doc, [predictions[-2]])["acc"] == 0.0
            if len(outputs) == 4:
                assert rn.process_results(doc, [predictions[3]])["acc"] == 50.0


# ------------------------------------------------------------------ through lm-eval
LM_TASKS = tuple(f"ccq_{task}" for task in TASKS)
QUESTION = re.compile(
    r"What (?:is|are all) the special magic (?:number|uuid)s? for (.+) mentioned in the provided text\?")


def asked_keys(prompt: str) -> list[str]:
    return re.split(r", and |, ", QUESTION.search(prompt).group(1))


def values_of(prompt: str, keys: list[str], asked: bool) -> list[str]:
    context = prompt[: prompt.rindex("\nWhat ")]
    return [value for key, value in NEEDLE_AT.findall(context) if (key in keys) == asked]


@pytest.fixture(scope="module")
def task_manager():
    metadata = {"tokenizer": "byt5", "lengths": [1024, 2048], "depths": [0, 50, 100], "samples_per_cell": 1}
    return TaskManager(include_path=str(ROOT / "tasks/ruler_niah"), include_defaults=False, metadata=metadata)


def run(task_manager, answer):
    lm = ScriptedLM(answer)
    out = simple_evaluate(model=lm, tasks=["ccq_ruler_niah"], task_manager=task_manager, log_samples=True,
                          bootstrap_iters=0)
    return lm, out


def test_tasks_load_through_task_manager(task_manager):
    assert {"ccq_ruler_niah", *LM_TASKS} <= set(task_manager.all_tasks)
    loaded = task_manager.load(["ccq_ruler_niah"])
    assert set(loaded["tasks"]) == set(LM_TASKS)
    for name, task in loaded["tasks"].items():
        docs = list(task.test_docs())
        cells = [(n, d) for n in (1024, 2048) for d in (0, 50, 100)]
        assert [(d["length"], d["depth"]) for d in docs] == cells
        assert all(d["prompt_tokens"] + 128 <= d["length"] and d["task"] == name for d in docs)
        declared = [m["metric"] for m in task.config.metric_list]
        assert declared == ["acc", *(f"acc_{n}" for n in cons.METRIC_LENGTHS)]
        assert task.config.generation_kwargs == {"until": [], "do_sample": False, "temperature": 0.0,
                                                 "max_gen_toks": 128}
        assert task.config.metadata["ccq_truncation"] == "error"


def test_scores_through_lm_eval(task_manager):
    def retriever(prompt: str) -> str:  # the values of the asked keys' needles
        return " " + ", ".join(values_of(prompt, asked_keys(prompt), True)) + "."

    lm, out = run(task_manager, retriever)
    assert len(lm.requests) == 5 * 6
    prompts = {sample["doc"]["input"] for name in LM_TASKS for sample in out["samples"][name]}
    assert {req.args[0] for req in lm.requests} == prompts  # the docs' prompts, sent unchanged
    for name in LM_TASKS:
        res = out["results"][name]
        assert res["acc,none"] == res["acc_1024,none"] == res["acc_2048,none"] == 100.0
        assert "acc_4096,none" not in res
    assert out["results"]["ccq_ruler_niah"]["acc,none"] == 100.0

    # the values of the needles whose key was not asked (multikey distractors), else the first asked value
    def other_or_first(prompt: str) -> str:
        keys = asked_keys(prompt)
        return " " + " ".join(values_of(prompt, keys, False)[:3] or values_of(prompt, keys, True)[:1])

    _, out = run(task_manager, other_or_first)
    results = {name: out["results"][name]["acc,none"] for name in LM_TASKS}
    assert results == {"ccq_niah_multikey_1": 0.0, "ccq_niah_multikey_2": 0.0, "ccq_niah_multikey_3": 0.0,
                       "ccq_niah_multivalue": 25.0, "ccq_niah_multiquery": 25.0}
    assert out["results"]["ccq_ruler_niah"]["acc,none"] == pytest.approx(10.0)
