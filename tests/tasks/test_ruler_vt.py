"""RULER variable tracking (tasks/ruler_vt): prompts against lm-eval 0.4.13's port (its own functions,
with their random draws fixed) converted to RULER's current layout, exact fit with two tokenizers, the
chain really being the answer, scoring, and the task end to end through lm-eval's TaskManager."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import re
import unittest.mock
from pathlib import Path

import pytest
import transformers
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from scripted_lm import ScriptedLM

ROOT = Path(__file__).resolve().parents[2]
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"
TOKENIZERS = {"byt5": "byt5", "mistral_v1": str(MISTRAL_DIR)}
BUDGET = 30  # RULER's tokens_to_generate for variable_tracking

vt = importlib.import_module("ccq_eval.tasks.ruler_vt.utils")
port = importlib.import_module("lm_eval.tasks.ruler.vt_utils")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ASSIGNMENT = re.compile(r"^VAR ([A-Z]+) = (?:(\d+)|VAR ([A-Z]+) )$")


# ------------------------------------------------------------------ the port, with fixed draws
@contextlib.contextmanager
def fixed_draws(names: list[str], example_names: list[str], value: str, positions_for):
    """The port's random draws made given inputs: 5-letter names cycle through `names`, 3-letter ones
    (the example's, and randomize_icl's renaming of them) through `example_names`, np.random.randint
    returns `value`, and random.sample(range(n), k) returns positions_for(n)."""
    five, three = itertools.cycle(names), itertools.cycle(example_names)
    with (
        unittest.mock.patch.object(port.random, "choices", lambda population, k: list(next(five if k == 5 else three))),
        unittest.mock.patch.object(port.np.random, "randint", lambda low, high: int(value)),
        unittest.mock.patch.object(port.random, "sample", lambda population, k: positions_for(len(population))),
    ):
        yield


def port_to_ruler(text: str) -> str:
    """lm-eval 0.4.13's port follows RULER's variable_tracking.py as of late 2024; RULER's commit that
    this task follows (tasks/ruler_vt/README.md) differs in exactly these points:"""
    # constants.py: the answer prefix's typo "assgined" was fixed to "assigned"
    text = text.replace("variables are assgined the value", "variables are assigned the value")
    # noise lines: the port joins "<noise>\n" items and assignments with " "; RULER joins bare lines with "\n"
    text = re.sub(r"(VAR [A-Z]+ = (?:\d+|VAR [A-Z]+ )) ", r"\1\n", text)
    text = text.replace("again.\n ", "again.\n").replace("again.\n\nQuestion:", "again.\nQuestion:")
    # the in-context example: RULER appends "\n" after its answer and "\n" before the question (port: "\n\n" each)
    text = re.sub(r"(they are: [ A-Z]+)\n\n\n\nMemorize", r"\1\n\nMemorize", text)
    return text


DRAW = vt.VtDraw(
    names=["QWERT", "ASDFG", "ZXCVB", "POIUY", "LKJHG"], value="48151", hop_fractions=[0.7, 0.1, 0.45, 0.3],
    example_names=["MNB", "VCX", "TRE", "YTU", "HGF"], example_value="62342", example_position_seed=99,
)


def test_prompt_equals_the_ports_construction_in_rulers_layout():
    tokenizer = vt.load_tokenizer("byt5")
    example_lines, depth = 7, 20  # the port's own fallback splits noise into sentences below 6 lines
    example_gaps = vt.example_gaps(example_lines, DRAW)
    with fixed_draws(DRAW.names, DRAW.example_names, DRAW.example_value, lambda n: example_gaps):
        example_input, example_answer = port.generate_input_output(example_lines, 1, 4, is_icl=True)
    assert example_answer == DRAW.example_names

    def port_sample(positions_for) -> dict:
        with fixed_draws(DRAW.names, DRAW.example_names, DRAW.value, positions_for):
            return port.sys_vartrack_w_noise_random(tokenizer, 1, 5000, icl_example={
                "input": example_input, "outputs": example_answer})[0]

    # the port sizes the haystack itself (steps of 10 lines): learn its size, then place the chain there
    lines = port_sample(lambda n: list(range(5)))["input"].split("Memorize")[-1].count(NOISE)
    gaps = vt.hop_gaps(lines, depth, DRAW.hop_fractions)
    assert lines >= 10 and len(set(gaps)) == 5  # a layout RULER's own rule can produce as well
    sample = port_sample(lambda n: gaps if n == lines else list(range(5)))
    assert sample["outputs"] == DRAW.names
    # lm-eval sends input + " " + gen_prefix; RULER sends input + answer_prefix (its trailing space kept)
    port_prompt = sample["input"] + " " + sample["gen_prefix"]
    ours, offsets = vt.build_prompt(DRAW, lines, depth, example_lines)
    assert ours == port_to_ruler(port_prompt) + " "
    assert port_prompt.count("assgined") == 2  # the conversions did apply (not a vacuous equality)
    assert ours.endswith("they are: ") and ours.count("\n\nMemorize") == 1
    for offset, statement in zip(offsets, vt.chain_statements(DRAW.names, DRAW.value), strict=True):
        assert ours[offset:].startswith(statement + "\n")

    # without an example the prompt is the question alone
    alone, _ = vt.build_prompt(DRAW, lines, depth, 0)
    assert ours.endswith(alone) and alone.startswith("Memorize and track") and alone.count("Memorize") == 1


def test_wording_is_rulers():
    assert port.CONFIG["variable_tracking"]["template"] == vt.TEMPLATE
    assert port.CONFIG["variable_tracking"]["answer_prefix"].replace("assgined", "assigned") == vt.ANSWER_PREFIX
    assert port.CONFIG["variable_tracking"]["tokens_to_generate"] == vt.GENERATION_BUDGET
    assert vt.chain_statements(["AB", "CD", "EF"], "123") == ["VAR AB = 123", "VAR CD = VAR AB ", "VAR EF = VAR CD "]


class WordCounter:
    """A tokenizer stand-in for the port: one token per whitespace-separated word."""

    def __call__(self, text: str):
        return unittest.mock.Mock(input_ids=text.split())


@contextlib.contextmanager
def port_random_state(seed: int):
    """The port draws from Python's and numpy's global generators: seed them, and put them back after."""
    state, np_state = port.random.getstate(), port.np.random.get_state()
    port.random.seed(seed)
    port.np.random.seed(seed)
    try:
        yield
    finally:
        port.random.setstate(state)
        port.np.random.set_state(np_state)


def test_the_ports_example_keeps_one_random_value_where_ours_draws_one_per_sample(capsys):
    """README: the port draws its example's value at random once (RULER: 12345, replaced per sample) and keeps
    it in every sample, its randomize_icl renaming the variables only; ours draws each sample's example."""
    with port_random_state(0):
        example = port.sys_vartrack_w_noise_random(WordCounter(), 1, 500, incremental=5)[0]
        samples = port.sys_vartrack_w_noise_random(WordCounter(), 4, 1500, icl_example=example)
    capsys.readouterr()  # the port prints its search
    (value,) = set(re.findall(r"VAR [A-Z]{3} = (\d+)", example["input"]))
    assert value != "12345"
    for sample in samples:
        head = sample["input"].split("\n\n\n\nMemorize")[0]  # the example, before the question
        assert re.findall(r"VAR [A-Z]{3} = (\d+)", head) == [value]
        assert not set(example["outputs"]) & set(re.findall(r"VAR ([A-Z]{3}) ", head))  # renamed
    ours = {vt.draw_sample(vt.cell_rng(42, vt.TASK, 1024, 50, index, family="ccq-ruler-vt")).example_value
            for index in range(4)}
    assert len(ours) == 4


def test_duplicate_names_fail_rulers_chain_and_ours_are_always_distinct():
    """README difference 5: a duplicate among the first five names makes RULER's (and the port's)
    generate_chains start a second chain and fail, so the sample is drawn again; ours redraws the name."""
    names = itertools.cycle(["AAAAA", "BBBBB", "AAAAA", "CCCCC", "DDDDD", "EEEEE"])
    with (unittest.mock.patch.object(port.random, "choices", lambda population, k: list(next(names))),
          pytest.raises(IndexError)):
        port.generate_chains(1, 4)
    drawn = iter(["AAAAA", "BBBBB", "AAAAA", "CCCCC", "DDDDD", "EEEEE"])
    rng = unittest.mock.Mock(choices=lambda population, k: list(next(drawn)))
    assert vt.draw_names(rng, 5, 5) == ["AAAAA", "BBBBB", "CCCCC", "DDDDD", "EEEEE"]


# ------------------------------------------------------------------ generated docs: fit and answers
GRID = {"lengths": [1024, 2048], "depths": [0, 50, 100], "samples_per_cell": 1}


@pytest.fixture(scope="module")
def tokenizers():
    # the Mistral folder straight through transformers: the shared loader would first import the model
    # registry (fla, seconds) only to learn that a folder is not a registered model name
    return {"byt5": vt.load_tokenizer("byt5"),
            "mistral_v1": transformers.AutoTokenizer.from_pretrained(MISTRAL_DIR, local_files_only=True)}


@pytest.fixture(scope="module")
def generated(tokenizers):
    by_spec = {spec: tokenizers[name] for name, spec in TOKENIZERS.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vt, "load_tokenizer", by_spec.__getitem__)
        return {name: vt.generate_docs(tokenizer=spec, **GRID) for name, spec in TOKENIZERS.items()}


def independent_count(tok_name: str, tokenizer, prompt: str) -> int:
    """Prompt tokens as the model sees them, without the task code: UTF-8 bytes for the byte-level
    tokenizer (no BOS); for Mistral the tokenizer's own encoding, BOS first."""
    if tok_name == "byt5":
        return len(prompt.encode("utf-8"))
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    return len(ids)


def draw_of(doc: dict):
    return vt.draw_sample(vt.cell_rng(doc["seed"], vt.TASK, doc["length"], doc["depth"], doc["sample"],
                                      family="ccq-ruler-vt"))


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
def test_prompts_fill_the_length_exactly(generated, tokenizers, tok_name):
    tokenizer, docs = tokenizers[tok_name], generated[tok_name]
    assert [(d["length"], d["depth"]) for d in docs] == [(n, d) for n in GRID["lengths"] for d in GRID["depths"]]
    for doc in docs:
        draw, n, lines = draw_of(doc), doc["num_haystack"], doc["example_haystack"]
        assert vt.build_prompt(draw, n, doc["depth"], lines)[0] == doc["input"]
        tokens = independent_count(tok_name, tokenizer, doc["input"])
        assert tokens == doc["prompt_tokens"] and tokens + BUDGET <= doc["length"]
        bigger = vt.build_prompt(draw, n + 1, doc["depth"], lines)[0]
        assert independent_count(tok_name, tokenizer, bigger) + BUDGET > doc["length"]
        # the example is there exactly when the sample keeps at least 5 noise lines beside it
        if lines:
            assert n >= 5 and lines == vt.fit_example(tokenizer, draw) and lines >= 5
        else:
            with_example = vt.build_prompt(draw, 5, doc["depth"], vt.fit_example(tokenizer, draw))[0]
            assert independent_count(tok_name, tokenizer, with_example) + BUDGET > doc["length"]
    if tok_name == "mistral_v1":  # RULER's 500-token example fits beside every sample here
        assert all(d["example_haystack"] > 5 for d in docs)
        for doc in docs:  # RULER counts the example's input (up to its answer prefix) without special tokens
            example_input = doc["input"][: doc["input"].index("they are: ") + len("they are: ")]
            assert len(tokenizer.encode(example_input, add_special_tokens=False)) <= 500
    else:  # bytes: no room for an example at 1024, RULER's smallest one (5 lines) at 2048
        assert [d["example_haystack"] for d in docs] == [0, 0, 0, 5, 5, 5]


def resolve(text: str) -> dict[str, str]:
    """Every variable's value, following the assignment lines of a context."""
    direct, links = {}, {}
    for line in text.split("\n"):
        match = ASSIGNMENT.match(line)
        if match:
            name, value, source = match.groups()
            (direct if value else links)[name] = value or source
    values = dict(direct)
    while len(values) < len(direct) + len(links):
        values.update({name: values[source] for name, source in links.items() if source in values})
    return values


def split_prompt(prompt: str) -> tuple[str, str]:
    """(example part or "", question part)."""
    head, sep, question = prompt.rpartition("\n\nMemorize and track")
    return (head, "Memorize and track" + question) if sep else ("", prompt)


def test_the_chain_is_the_answer_and_starts_at_its_depth(generated):
    for docs in generated.values():
        for doc in docs:
            example, question = split_prompt(doc["input"])
            values = resolve(question)
            assert sorted(name for name, value in values.items() if value == doc["value"]) == sorted(doc["outputs"])
            assert len(values) == 5 and doc["outputs"] == doc["variables"] and len(set(doc["outputs"])) == 5
            assert all(re.fullmatch(r"[A-Z]{5}", name) for name in doc["outputs"])
            assert re.fullmatch(r"\d{5}", doc["value"])
            assert question.endswith(f"Answer: According to the chain(s) of variable assignment in the text above, 5 "
                                     f"variables are assigned the value {doc['value']}, they are: ")
            # the first assignment goes before noise line int(n * depth / 100); the hops come after it in order
            lines = question.split("\n\n", 1)[1].split("\nQuestion:")[0].split("\n")
            rows = [i for i, line in enumerate(lines) if line.startswith("VAR ")]
            assert lines[rows[0]] == f"VAR {doc['outputs'][0]} = {doc['value']}"
            assert rows[0] == int(doc["num_haystack"] * doc["depth"] / 100)
            assert [lines[r].split()[1] for r in rows] == doc["outputs"]
            assert len(lines) == doc["num_haystack"] + 5 and lines.count(NOISE) == doc["num_haystack"]
            statements = vt.chain_statements(doc["outputs"], doc["value"])
            for offset, statement in zip(doc["needle_char_offsets"], statements, strict=True):
                assert doc["input"][offset:].startswith(statement)
            if example:  # the example's own chain answers its own question, with other names and value
                example_question, answer = example.rsplit("they are: ", 1)
                example_value = re.search(r"assigned the value (\d+) in", example_question).group(1)
                example_values = resolve(example_question)
                assert sorted(k for k, v in example_values.items() if v == example_value) == sorted(answer.split())
                assert answer.startswith(" ") and len(answer.split()) == 5
                assert doc["input"].count(f"they are: {answer}\n\nMemorize and track") == 1
                assert all(re.fullmatch(r"[A-Z]{3}", name) for name in answer.split())
                assert example_question.count(NOISE) == doc["example_haystack"]


def test_generation_is_deterministic_and_seeded():
    kwargs = {"tokenizer": "byt5", "lengths": [1024], "depths": [10, 90], "samples_per_cell": 2}
    first = vt.generate_docs(**kwargs)
    assert first == vt.generate_docs(**kwargs)
    assert [d["value"] for d in vt.generate_docs(seed=7, **kwargs)] != [d["value"] for d in first]
    alone = vt.generate_docs(tokenizer="byt5", lengths=[1024], depths=[90], samples_per_cell=1)
    assert alone[0]["input"] == first[2]["input"]  # a cell does not depend on the rest of the grid


def test_too_small_length_names_the_minimum():
    with pytest.raises(vt.VariableTrackingError, match=r"length 512 is too small .*minimum length is (\d+)") as err:
        vt.generate_docs(tokenizer="byt5", lengths=[512], depths=[50])
    minimum = int(re.search(r"minimum length is (\d+)", str(err.value)).group(1))
    draw = vt.draw_sample(vt.cell_rng(42, vt.TASK, 512, 50, 0, family="ccq-ruler-vt"))
    tokenizer = vt.load_tokenizer("byt5")
    sample = vt.make_sample(tokenizer, draw, length=minimum, depth=50, guess=3)
    assert sample.num_haystack == 1 and sample.example_haystack == 0 and sample.prompt_tokens + BUDGET == minimum


# ------------------------------------------------------------------ scoring
def test_scoring_is_rulers_string_match_all():
    doc = {"outputs": ["QWERT", "ASDFG", "ZXCVB", "POIUY", "LKJHG"], "length": 2048}
    assert vt.process_results(doc, [" QWERT ASDFG ZXCVB POIUY LKJHG"]) == {"acc": 100.0, "acc_2048": 100.0}
    assert vt.process_results(doc, ["qwert, asdfg\x00zxcvb"])["acc"] == pytest.approx(60.0)
    assert vt.process_results(doc, ["none of them"]) == {"acc": 0.0, "acc_2048": 0.0}


# ------------------------------------------------------------------ through lm-eval
METADATA = {"tokenizer": "byt5", "lengths": [1024, 2048], "depths": [0, 50, 100], "samples_per_cell": 1}


def solve(prompt: str) -> str:
    """A perfect tracker: follows the question's chain from the value the question asks about."""
    question = split_prompt(prompt)[1]
    value = re.search(r"assigned the value (\d+) in the text above\.", question).group(1)
    return " " + " ".join(name for name, v in resolve(question).items() if v == value)


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(ROOT / "tasks/ruler_vt"), include_defaults=False, metadata=METADATA)


def test_task_builds_and_scores_through_lm_eval(task_manager):
    assert "ccq_ruler_vt" in task_manager.all_tasks
    lm = ScriptedLM(solve)
    out = simple_evaluate(model=lm, tasks=["ccq_ruler_vt"], task_manager=task_manager, log_samples=True,
                          bootstrap_iters=0)
    res = out["results"]["ccq_ruler_vt"]
    assert res["acc,none"] == 100.0 and res["acc_1024,none"] == 100.0 and res["acc_2048,none"] == 100.0
    assert "acc_4096,none" not in res
    docs = [sample["doc"] for sample in out["samples"]["ccq_ruler_vt"]]
    assert sorted((d["length"], d["depth"]) for d in docs) == [(n, d) for n in (1024, 2048) for d in (0, 50, 100)]
    assert len(lm.requests) == 6
    for req in lm.requests:
        context, gen_kwargs = req.args
        assert context in {d["input"] for d in docs} and context.endswith("they are: ")  # sent unchanged
        assert gen_kwargs == {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": 30}

    # the first two variables only: 40 on every sample
    half = ScriptedLM(lambda prompt: " ".join(solve(prompt).split()[:2]))
    out = simple_evaluate(model=half, tasks=["ccq_ruler_vt"], task_manager=task_manager, bootstrap_iters=0)
    assert out["results"]["ccq_ruler_vt"]["acc,none"] == pytest.approx(40.0)
