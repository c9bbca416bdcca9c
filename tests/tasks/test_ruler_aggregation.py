"""RULER common-words (cwe) and frequent-words (fwe) extraction (tasks/ruler_aggregation): prompts
against lm-eval 0.4.13's port (its own functions, with their random draws fixed), exact fit with two
tokenizers, the answers really being the most frequent words, scoring, and both tasks and their group
end to end through lm-eval's TaskManager."""

from __future__ import annotations

import importlib
import random
import re
import unittest.mock
from collections import Counter
from pathlib import Path

import pytest
import transformers
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from scripted_lm import ScriptedLM

ROOT = Path(__file__).resolve().parents[2]
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"
TOKENIZERS = {"byt5": "byt5", "mistral_v1": str(MISTRAL_DIR)}

ag = importlib.import_module("ccq_eval.tasks.ruler_aggregation.utils")
cwe_port = importlib.import_module("lm_eval.tasks.ruler.cwe_utils")
fwe_port = importlib.import_module("lm_eval.tasks.ruler.fwe_utils")

CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
FWE_HEAD = "Find the three most frequently appeared coded words. "


class FreshShuffle:
    """RULER shuffles each list with a fresh random.Random(random_seed); the port with one generator
    whose state advances (its RNG). Standing in for the port's RNG, this gives RULER's behaviour."""

    def __init__(self, seed: int):
        self.seed = seed

    def shuffle(self, items: list) -> None:
        random.Random(self.seed).shuffle(items)


def port_cwe(samples: list[list[str]], shuffle_seed: int, call):
    """Run `call` with the port's random.sample returning the given word lists in turn."""
    given = iter(samples)
    with (
        unittest.mock.patch.object(cwe_port.random, "sample", lambda population, k: list(next(given))),
        unittest.mock.patch.object(cwe_port, "RNG", FreshShuffle(shuffle_seed)),
    ):
        return call()


@pytest.fixture(scope="module")
def cwe_draw():
    words = list(ag.load_words())
    rng = random.Random(5)
    return ag.CweDraw(order=rng.sample(words, len(words)), example_order=rng.sample(words, 40), shuffle_seed=42)


# ------------------------------------------------------------------ (a) the port's construction
def test_wording_and_settings_are_rulers():
    assert cwe_port.CONFIG["template"] == ag.CWE_TEMPLATE
    assert cwe_port.CONFIG["answer_prefix"] == ag.CWE_ANSWER_PREFIX
    assert cwe_port.CONFIG["tokens_to_generate"] == ag.CWE_BUDGET
    assert fwe_port.CONFIG["template"] == ag.FWE_TEMPLATE
    assert fwe_port.CONFIG["answer_prefix"] == ag.FWE_ANSWER_PREFIX
    assert fwe_port.CONFIG["tokens_to_generate"] == ag.FWE_BUDGET
    # RULER's word pool: wonderwords' nouns, adjectives and verbs, deduplicated
    assert list(ag.load_words()) == sorted(cwe_port.WORDS) and len(ag.load_words()) > 8000
    scipy_special = importlib.import_module("scipy.special")  # what RULER and the port call
    assert scipy_special.zeta(ag.ALPHA) == ag.ZETA_ALPHA


@pytest.mark.parametrize("length", [2048, 8192])
def test_cwe_prompt_with_example_equals_the_ports(cwe_draw, length):
    tokenizer = ag.load_tokenizer("byt5")
    sample = ag.make_cwe_sample(tokenizer, cwe_draw, length=length, guess=30)
    setting = sample.setting
    assert setting.name == ("ruler" if length >= 4096 else "ruler-short")  # RULER's own setting fits here
    input_example, input_text, answer = port_cwe(
        [cwe_draw.example_order[: setting.example_words], cwe_draw.order[: sample.num_words]], 42,
        lambda: cwe_port.generate_input_output(sample.num_words, length))
    assert answer == cwe_draw.order[: ag.NUM_CW]
    # RULER (common_words_extraction.py) puts " " between the example's answer prefix and its answer (the
    # port leaves it out) and joins example and question with "\n" (the port drops the example)
    head, example_answer = input_example.rsplit(ag.CWE_ANSWER_PREFIX, 1)
    assert example_answer.startswith("1. ")
    assert sample.prompt == head + ag.CWE_ANSWER_PREFIX + " " + example_answer + "\n" + input_text


@pytest.mark.parametrize("setting", [s for s in ag.CWE_SETTINGS if not s.example_words], ids=lambda s: s.name)
def test_cwe_prompt_without_example_equals_the_ports(cwe_draw, setting):
    num_words = 37
    context, common = port_cwe([cwe_draw.order[:num_words]], 42, lambda: cwe_port.get_example(
        num_words, setting.freq_cw, setting.freq_ucw, ag.NUM_CW))
    assert common == cwe_draw.order[: ag.NUM_CW]
    assert ag.cwe_prompt(cwe_draw, setting, num_words) == cwe_port.TEMPLATE.format(context=context, query="")


def test_fwe_prompt_equals_the_ports():
    tokenizer = ag.load_tokenizer("byt5")
    length = 2048
    words = ag.draw_coded_words(random.Random(3), ag.fwe_vocab_size(length))
    ranked = ag.rank_vocab(words, 42)  # the port ranks and shuffles with random.Random(42)
    sample = ag.make_fwe_sample(tokenizer, ranked, 42, length=length, guess=100)
    given = iter(words)
    with unittest.mock.patch.object(fwe_port.random, "choices", lambda population, k: list(next(given))):
        text, answer, num_words = fwe_port.generate_input_output(
            10**9, tokenizer, num_words=sample.num_words, coded_wordlen=6, vocab_size=len(words), alpha=2.0)
    assert (text, answer, num_words) == (sample.prompt, sample.answer, sample.num_words)


# ------------------------------------------------------------------ (b) exact fit, (c) answers
GRID = {"lengths": [1024, 2048], "samples_per_cell": 2}


@pytest.fixture(scope="module")
def tokenizers():
    # the Mistral folder straight through transformers: the shared loader would first import the model
    # registry (fla, seconds) only to learn that a folder is not a registered model name
    return {"byt5": ag.load_tokenizer("byt5"),
            "mistral_v1": transformers.AutoTokenizer.from_pretrained(MISTRAL_DIR, local_files_only=True)}


@pytest.fixture(scope="module")
def generated(tokenizers):
    by_spec = {spec: tokenizers[name] for name, spec in TOKENIZERS.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ag, "load_tokenizer", by_spec.__getitem__)
        return {(name, task): ag.generate_docs(task, tokenizer=spec, **GRID)
                for name, spec in TOKENIZERS.items() for task in (ag.CWE_TASK, ag.FWE_TASK)}


def independent_count(tok_name: str, tokenizer, prompt: str) -> int:
    """Prompt tokens as the model sees them, without the task code: UTF-8 bytes for the byte-level
    tokenizer (no BOS); for Mistral the tokenizer's own encoding, BOS first."""
    if tok_name == "byt5":
        return len(prompt.encode("utf-8"))
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    return len(ids)


def rng_of(doc: dict) -> random.Random:
    return ag.cell_rng(doc["seed"], doc["task"], doc["length"], ag.NO_DEPTH, doc["sample"], family=ag.FAMILY)


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_cwe_prompts_fill_the_length_exactly(generated, tokenizers, tok_name):
    tokenizer, docs = tokenizers[tok_name], generated[(tok_name, ag.CWE_TASK)]
    assert [(d["length"], d["sample"]) for d in docs] == [(n, i) for n in (1024, 2048) for i in (0, 1)]
    for doc in docs:
        draw, n = ag.draw_cwe(rng_of(doc)), doc["num_haystack"]
        setting = next(s for s in ag.CWE_SETTINGS if (s.freq_cw, s.example_words) == (doc["freq_cw"],
                                                                                    doc["example_words"]))
        assert "depth" not in doc and ag.cwe_prompt(draw, setting, n) == doc["input"]
        tokens = independent_count(tok_name, tokenizer, doc["input"])
        assert tokens == doc["prompt_tokens"] and tokens + ag.CWE_BUDGET <= doc["length"]
        bigger = ag.cwe_prompt(draw, setting, n + 1)
        assert independent_count(tok_name, tokenizer, bigger) + ag.CWE_BUDGET > doc["length"]
        # the setting is the first (from RULER's below 4096 tokens on) whose 20-word prompt fits
        assert n >= ag.CWE_MIN_WORDS
        for earlier in ag.CWE_SETTINGS[1 : ag.CWE_SETTINGS.index(setting)]:
            smallest = ag.cwe_prompt(draw, earlier, ag.CWE_MIN_WORDS)
            assert independent_count(tok_name, tokenizer, smallest) + ag.CWE_BUDGET > doc["length"]
    if tok_name == "mistral_v1":  # RULER's own setting (with its example) everywhere
        assert {(d["freq_cw"], d["freq_ucw"], d["example_words"]) for d in docs} == {(6, 1, 20)}
    else:  # bytes: 1024 holds no example and not even 10 words x 6; 2048 is near RULER's short setting
        assert [(d["freq_cw"], d["example_words"]) for d in docs[:2]] == [(3, 0), (3, 0)]
        assert {(d["freq_cw"], d["example_words"]) for d in docs[2:]} <= {(6, 20), (6, 0)}


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_fwe_prompts_fill_the_length_exactly(generated, tokenizers, tok_name):
    tokenizer, docs = tokenizers[tok_name], generated[(tok_name, ag.FWE_TASK)]
    assert [(d["length"], d["sample"]) for d in docs] == [(n, i) for n in (1024, 2048) for i in (0, 1)]
    for doc in docs:
        ranked, seed = ag.draw_fwe(rng_of(doc), doc["length"])
        n = doc["num_haystack"]
        assert "depth" not in doc and len(ranked) == doc["vocab_size"] == (doc["length"] - 50) // 50
        assert ag.fwe_question(ag.fwe_context(ranked, n, seed)[0]) == doc["input"]
        tokens = independent_count(tok_name, tokenizer, doc["input"])
        assert tokens == doc["prompt_tokens"] and tokens + ag.FWE_BUDGET <= doc["length"]
        bigger = ag.fwe_question(ag.fwe_context(ranked, n + 1, seed)[0])
        assert independent_count(tok_name, tokenizer, bigger) + ag.FWE_BUDGET > doc["length"]


def numbered_list(text: str) -> list[str]:
    """The words of "1. w 2. w ..." (words may hold spaces or hyphens)."""
    assert text.startswith("1. ")
    words, start, i = [], 3, 1
    while True:
        marker = f" {i + 1}. "
        end = text.find(marker, start)
        words.append(text[start:] if end < 0 else text[start:end])
        if end < 0:
            return words
        start, i = end + len(marker), i + 1


def cwe_lists(prompt: str) -> list[tuple[list[str], list[str] | None]]:
    """(word list, answer given after it or None) of the example (if any) and the question."""
    parts = []
    for block in prompt.split(CWE_HEAD)[1:]:
        listed, rest = block.split("\nQuestion: What are the 10 most common words in the above list?", 1)
        answer = rest.split(ag.CWE_ANSWER_PREFIX, 1)[1].split("\n", 1)[0]
        parts.append((numbered_list(listed), numbered_list(answer[1:]) if answer else None))
    return parts


def test_cwe_answer_is_the_ten_most_common_words(generated):
    for (_, task), docs in generated.items():
        for doc in docs if task == ag.CWE_TASK else []:
            parts = cwe_lists(doc["input"])
            assert len(parts) == (2 if doc["example_words"] else 1)
            words, given = parts[-1]
            assert given is None and doc["input"].endswith(ag.CWE_ANSWER_PREFIX)
            counts = Counter(words)
            assert len(counts) == doc["num_haystack"] and doc["outputs"] == doc["common_words"]
            assert {w for w, c in counts.items() if c == doc["freq_cw"]} == set(doc["outputs"])
            assert len(doc["outputs"]) == 10 and all(c == doc["freq_ucw"] < doc["freq_cw"]
                                                      for w, c in counts.items() if w not in doc["outputs"])
            if doc["example_words"]:  # the example answers its own list with its 10 most common words
                example_words, example_answer = parts[0]
                example_counts = Counter(example_words)
                assert len(example_counts) == doc["example_words"] and len(example_answer) == 10
                top = example_counts.most_common()
                assert {w for w, _ in top[:10]} == set(example_answer) and top[9][1] > top[10][1]


def test_fwe_answer_is_the_three_most_frequent_words(generated):
    for (_, task), docs in generated.items():
        for doc in docs if task == ag.FWE_TASK else []:
            text = doc["input"].split(FWE_HEAD, 1)[1].split("\nQuestion:", 1)[0]
            counts = Counter(text.split(" "))
            dots = counts.pop("...")
            top = counts.most_common()
            assert {w for w, _ in top[:3]} == set(doc["outputs"]) and top[2][1] > top[3][1]
            assert [counts[w] for w in doc["outputs"]] == doc["answer_counts"] and dots > top[0][1]
            assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)
            assert doc["input"].endswith(ag.FWE_ANSWER_PREFIX)


def test_fwe_smallest_size_is_the_first_from_which_the_answer_is_always_defined():
    for vocab_size in (4, 5, 19, 200):
        minimum = ag.fwe_min_words(vocab_size)
        assert all(ag.answer_is_defined(n, vocab_size) for n in range(minimum, 3000))
        assert minimum == 1 or not ag.answer_is_defined(minimum - 1, vocab_size)
    with pytest.raises(ag.AggregationError, match="vocabulary of at least 4 words"):
        ag.fwe_min_words(3)


def test_depths_are_ignored_and_generation_is_deterministic():
    kwargs = {"tokenizer": "byt5", "lengths": [1024], "samples_per_cell": 2}
    for task in (ag.CWE_TASK, ag.FWE_TASK):
        first = ag.generate_docs(task, **kwargs)
        assert first == ag.generate_docs(task, depths=[10, 90], **kwargs)
        assert [d["outputs"] for d in ag.generate_docs(task, seed=7, **kwargs)] != [d["outputs"] for d in first]
        assert first[0]["outputs"] != first[1]["outputs"]


def test_lengths_out_of_reach_are_explained(monkeypatch):
    with pytest.raises(ag.AggregationError, match=r"length 256 is too small for ccq_ruler_cwe.*minimum length is"):
        ag.generate_docs(ag.CWE_TASK, tokenizer="byt5", lengths=[256])
    with pytest.raises(ag.AggregationError, match=r"length 256 is too small for ccq_ruler_fwe.*minimum length is"):
        ag.generate_docs(ag.FWE_TASK, tokenizer="byt5", lengths=[512, 256])
    # the minimum fwe gives is one that fits: a longer length has a larger vocabulary, whose smallest text with
    # a defined answer is longer (53 words from 5 words on, 27 with 256's 4), so 256's own text does not tell it
    tokenizer = ag.load_tokenizer("byt5")

    def fwe_fits(length: int) -> bool:
        ranked, shuffle_seed = ag.draw_fwe(ag.cell_rng(42, ag.FWE_TASK, length, ag.NO_DEPTH, 0, family=ag.FAMILY),
                                           length)
        try:
            ag.make_fwe_sample(tokenizer, ranked, shuffle_seed, length=length, guess=64)
        except ag.AggregationError:
            return False
        return True

    for length in (256, 512):
        with pytest.raises(ag.AggregationError, match=r"so the minimum length is (\d+) \(the shortest length with a "
                                                      r"metric: 1024\)$") as error:
            ag.generate_docs(ag.FWE_TASK, tokenizer="byt5", lengths=[length])
        minimum = int(re.search(r"minimum length is (\d+)", str(error.value)).group(1))
        assert minimum == 639 and fwe_fits(minimum) and not fwe_fits(minimum - 1), (length, minimum)
    # a pool too small for the length (the real one runs out only at the longest lengths)
    monkeypatch.setattr(ag, "load_words", lambda: tuple(f"word{i}" for i in range(60)))
    with pytest.raises(ag.AggregationError, match="more than the 60 distinct words of the word pool"):
        ag.generate_docs(ag.CWE_TASK, tokenizer="byt5", lengths=[4096])


# ------------------------------------------------------------------ (d) scoring
def test_scoring_is_rulers_string_match_all():
    doc = {"outputs": ["apple", "dune buggy", "know-how"], "length": 1024}
    assert ag.process_results(doc, [" 1. Apple 2. dune buggy 3. know-how"]) == {"acc": 100.0, "acc_1024": 100.0}
    assert ag.process_results(doc, ["apple\nknow-how"])["acc"] == pytest.approx(200 / 3)
    assert ag.process_results(doc, ["pear"]) == {"acc": 0.0, "acc_1024": 0.0}


# ------------------------------------------------------------------ (e) through lm-eval
METADATA = {"tokenizer": "byt5", "lengths": [1024, 2048], "samples_per_cell": 2}


def solve(prompt: str, how_many: int | None = None) -> str:
    """A perfect counter: the most frequent words of the question's list or coded text."""
    if prompt.startswith(CWE_HEAD):
        top = [w for w, _ in Counter(cwe_lists(prompt)[-1][0]).most_common(how_many or 10)]
        return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(top))
    counts = Counter(prompt.split(FWE_HEAD, 1)[1].split("\nQuestion:", 1)[0].split(" "))
    counts.pop("...")
    return " " + " ".join(w for w, _ in counts.most_common(how_many or 3))


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(ROOT / "tasks/ruler_aggregation"), include_defaults=False,
                       metadata=METADATA)


def test_tasks_build_and_score_through_lm_eval(task_manager):
    assert {"ccq_ruler_aggregation", ag.CWE_TASK, ag.FWE_TASK} <= set(task_manager.all_tasks)
    lm = ScriptedLM(solve)
    out = simple_evaluate(model=lm, tasks=["ccq_ruler_aggregation"], task_manager=task_manager, log_samples=True,
                          bootstrap_iters=0)
    for task, budget in ((ag.CWE_TASK, 120), (ag.FWE_TASK, 50)):
        res = out["results"][task]
        assert res["acc,none"] == 100.0 and res["acc_1024,none"] == 100.0 and res["acc_2048,none"] == 100.0
        assert "acc_4096,none" not in res
        docs = [sample["doc"] for sample in out["samples"][task]]
        assert sorted((d["length"], d["sample"]) for d in docs) == [(n, i) for n in (1024, 2048) for i in (0, 1)]
        requests = [req for req in lm.requests if req.task_name == task]
        assert len(requests) == 4
        for req in requests:
            context, gen_kwargs = req.args
            assert context in {d["input"] for d in docs}  # sent unchanged
            assert gen_kwargs == {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": budget}
    assert out["results"]["ccq_ruler_aggregation"]["acc,none"] == 100.0

    # one right word per sample: 10 on cwe, 100/3 on fwe, their unweighted mean for the group
    one = ScriptedLM(lambda prompt: solve(prompt, how_many=1))
    out = simple_evaluate(model=one, tasks=["ccq_ruler_aggregation"], task_manager=task_manager, bootstrap_iters=0)
    assert out["results"][ag.CWE_TASK]["acc,none"] == pytest.approx(10.0)
    assert out["results"][ag.FWE_TASK]["acc,none"] == pytest.approx(100 / 3)
    assert out["results"]["ccq_ruler_aggregation"]["acc,none"] == pytest.approx((10 + 100 / 3) / 2)
