"""RULER QA (ccq_ruler_qa_squad / _hotpot): readers and prompts against lm-eval 0.4.13's port of RULER,
exact fit in two tokenizers, string_match_part, the missing-data error, the gold document at its depth,
and the tasks through lm-eval's TaskManager with fixture data in the official formats."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from scripted_lm import ScriptedLM

from ccq_eval.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "ruler_qa"
MISTRAL_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "mistral_v1"
TOKENIZERS = {"byt5": "byt5", "mistral_v1": str(MISTRAL_DIR)}
TASKS = ("ccq_ruler_qa_squad", "ccq_ruler_qa_hotpot")
GRID = {"lengths": [1024, 2048], "depths": [0, 50, 100], "samples_per_cell": 1}

qa = importlib.import_module("ccq_eval.tasks.ruler_qa.utils")
qa_data = importlib.import_module("ccq_eval.tasks.ruler_qa.data")
port = importlib.import_module("lm_eval.tasks.ruler.qa_utils")
port_common = importlib.import_module("lm_eval.tasks.ruler.common_utils")


def fixture_json(task: str):
    name = "dev-v2.0.json" if task == "ccq_ruler_qa_squad" else "hotpot_dev_distractor_v1.json"
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def gold_by_question(task: str) -> dict[str, tuple[list[str], list[str]]]:
    """question -> (gold document texts, answers), read from the fixture JSON without the task code."""
    out = {}
    if task == "ccq_ruler_qa_squad":
        for article in fixture_json(task)["data"]:
            for paragraph in article["paragraphs"]:
                for q in paragraph["qas"]:
                    if not q["is_impossible"]:
                        out[q["question"]] = ([paragraph["context"]], [a["text"] for a in q["answers"]])
    else:
        for record in fixture_json(task):
            titles = {t for t, _ in record["supporting_facts"]}
            gold = [t + "\n" + "".join(s) for t, s in record["context"] if t in titles]
            out[record["question"]] = (gold, [record["answer"]])
    return out


def prompt_documents(prompt: str) -> list[str]:
    """The documents of a prompt, in order (the format itself is checked against the port below)."""
    start = prompt.index("The following are given documents.\n\n") + len("The following are given documents.\n\n")
    end = prompt.rindex("\n\nAnswer the question based on the given documents.")
    return re.split(r"\n\nDocument \d+:\n", "\n\n" + prompt[start:end])[1:]


@pytest.fixture(scope="module")
def tokenizers():
    return {name: qa.load_tokenizer(spec) for name, spec in TOKENIZERS.items()}


@pytest.fixture(scope="module")
def generated():
    return {(tok, task): qa.generate_docs(task, tokenizer=spec, qa_dir=str(FIXTURES), **GRID)
            for tok, spec in TOKENIZERS.items() for task in TASKS}


def data_for(task: str):
    return qa_data.load_qa_data(task, FIXTURES)


def sample_of(doc: dict) -> qa.QASample:
    return qa.sample_for(data_for(doc["task"]), doc["task"], seed=doc["seed"], length=doc["length"],
                         depth=doc["depth"], index=doc["sample"])


# ------------------------------------------------------------------ (a) the same as lm-eval's port
@pytest.mark.parametrize("task", TASKS)
def test_readers_equal_the_ports_readers(monkeypatch, task):
    raw = fixture_json(task)
    # the port downloads its json: hand it the fixture instead (a url of its own, since read_* are cached)
    monkeypatch.setattr(port, "download_json", lambda url: raw)
    ours = data_for(task)
    if task == "ccq_ruler_qa_squad":
        port_qas, port_docs = port.read_squad(url=f"fixture:{FIXTURES}/squad")
        assert ours.documents == port_docs
        assert ours.questions == port_qas  # answerable only, paragraph as gold, article's others preferred
        assert len(ours.questions) == len(gold_by_question(task)) and len(ours.documents) == 14
    else:
        port_qas, port_docs = port.read_hotpotqa(url=f"fixture:{FIXTURES}/hotpot")
        assert ours.documents == port_docs and len(ours.documents) == 28  # two paragraphs shared by records
        assert [q["query"] for q in ours.questions] == [q["query"] for q in port_qas]
        assert [q["outputs"] for q in ours.questions] == [q["outputs"] for q in port_qas]
        gold = gold_by_question(task)
        for mine, theirs in zip(ours.questions, port_qas, strict=True):
            # RULER keeps all ten paragraphs of the record; here split into supporting (gold) and the rest
            assert sorted(mine["context"] + mine["more_context"]) == sorted(theirs["context"])
            assert [ours.documents[i] for i in mine["context"]] == gold[mine["query"]][0]


def test_constants_are_the_ports():
    assert qa.TEMPLATE == port.TEMPLATE == port.CONFIG["template"]
    assert qa.DOCUMENT_PROMPT == port.DOCUMENT_PROMPT
    assert qa.GENERATION_BUDGET == port.CONFIG["tokens_to_generate"] == 32


def render_like_lm_eval(port_doc: dict) -> str:
    """The context lm-eval sends for a doc of the port's ruler_qa_squad task: its YAML's doc_to_text,
    gen_prefix and target_delimiter rendered by lm-eval's own zero-shot turn builder."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.api.utils import messages_to_text
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.utils import apply_template

    config = load_yaml(Path(port.__file__).parent / "qa_squad.yaml", resolve_func=False)
    question = apply_template(config["doc_to_text"], port_doc)
    gen_prefix = apply_template(config["gen_prefix"], port_doc)
    messages = ConfigurableTask.build_qa_turn(None, q=question, gen_prefix=gen_prefix,
                                              tgt_delim=config["target_delimiter"], few_delim="")
    return messages_to_text(messages)


@pytest.mark.parametrize("task", TASKS)
def test_prompt_equals_the_ports_byte_for_byte(generated, tokenizers, task):
    for doc in generated[("byt5", task)]:
        sample = sample_of(doc)
        documents = sample.documents(doc["num_haystack"])
        assert doc["input"] == qa.build_prompt(documents, doc["question"])
        assert len(set(documents)) == len(documents)  # no repeats at these lengths: order recoverable below
        gold_at = [documents.index(g) for g in sample.gold]
        # the port builds its own prompt over the same documents and question (it shuffles them)
        port_docs = port.generate_samples(
            tokenizer=tokenizers["byt5"], docs=list(documents),
            qas=[{"query": doc["question"], "outputs": doc["outputs"], "context": gold_at}],
            max_seq_length=10**6, num_samples=1)
        (port_doc,) = port_docs
        rendered = render_like_lm_eval(port_doc)
        assert rendered.endswith(f"Question: {doc['question']} Answer:")
        positions = {d: rendered.index(d) for d in documents}
        assert all(a not in b for a in documents for b in documents if a != b)  # each found where it is
        port_order = sorted(documents, key=positions.__getitem__)
        assert qa.build_prompt(port_order, doc["question"]) == rendered


# ------------------------------------------------------------------ (b) exact fit
def independent_count(tok_name: str, tokenizer, prompt: str) -> int:
    if tok_name == "byt5":
        return len(prompt.encode("utf-8"))
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] != tokenizer.eos_token_id
    return len(ids)


@pytest.mark.parametrize("tok_name", list(TOKENIZERS))
@pytest.mark.parametrize("task", TASKS)
def test_prompt_fits_exactly(generated, tokenizers, tok_name, task):
    tokenizer = tokenizers[tok_name]
    docs = generated[(tok_name, task)]
    assert [(d["length"], d["depth"]) for d in docs] == [(n, d) for n in GRID["lengths"] for d in GRID["depths"]]
    for doc in docs:
        n, length = doc["num_haystack"], doc["length"]
        tokens = independent_count(tok_name, tokenizer, doc["input"])
        assert tokens == doc["prompt_tokens"] and tokens + 32 <= length
        sample = sample_of(doc)
        assert sample.prompt(n) == doc["input"]
        # one more distractor document: the same documents plus one, and it would not fit
        fewer, more = sample.documents(n), sample.documents(n + 1)
        assert len(more) == len(fewer) + 1 and all(more.count(d) >= fewer.count(d) for d in fewer)
        assert independent_count(tok_name, tokenizer, sample.prompt(n + 1)) + 32 > length
        assert doc["num_documents"] == n + len(sample.gold) == len(prompt_documents(doc["input"]))
        assert doc["generation_budget"] == 32 and doc["haystack_unit"] == "document"
        assert doc["data_file"] == ("dev-v2.0.json" if task == "ccq_ruler_qa_squad" else
                                    "hotpot_dev_distractor_v1.json")


def test_preferred_distractors_come_first_and_documents_repeat_only_when_used_up():
    for task in TASKS:
        data = data_for(task)
        for index in range(5):
            sample = qa.sample_for(data, task, seed=3, length=4096, depth=50, index=index)
            question = data.questions[sample.question_index]
            preferred = set(question["more_context"])
            items = [doc for doc, _ in sample.stream.take(2 * len(data.documents))]
            k = len(preferred)
            assert set(items[:k]) == preferred  # RULER: the article's (record's) other paragraphs first
            distinct = len(data.documents) - len(question["context"])
            assert len(set(items[:distinct])) == distinct and not set(items) & set(question["context"])
            assert items[distinct:2 * distinct] == items[:distinct]  # then the same sequence again


# ------------------------------------------------------------------ (c) scoring
def ruler_string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    # NVIDIA RULER scripts/eval/synthetic/constants.py, restated (without its rounding)
    return sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs)) / len(
        preds) * 100


@pytest.mark.parametrize(("prediction", "answers"), [
    (" Paris.", ["Paris", "in Paris"]),
    ("It was made IN PARIS", ["in Paris", "Paris"]),
    ("the harrowgate cows", ["the Harrowgate Cows", "Harrowgate Cows"]),
    ("Lyon", ["Paris", "in Paris"]),
    ("\x02 212 steps\n", ["212 steps", "212"]),
    ("", ["viola"]),
])
def test_string_match_part_is_rulers(prediction, answers):
    doc = {"outputs": answers, "length": 2048}
    expected = ruler_string_match_part([qa.postprocess_prediction(prediction)], [answers])
    assert qa.process_results(doc, [prediction]) == {"acc": expected, "acc_2048": expected}
    assert expected in (0.0, 100.0)


def test_any_answer_scores_full_marks_unlike_the_ports_fraction():
    # one of two gold answers found: RULER (and we) 100; the port's string_match_part gives the fraction
    assert qa.string_match_part("Paris", ["Paris", "in Paris"]) == 100.0
    assert port_common.string_match_part(["Paris"], [["Paris", "in Paris"]]) == 0.5


# ------------------------------------------------------------------ (d) missing data
def test_missing_data_is_one_line_naming_both_ways(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for task, file_name in (("ccq_ruler_qa_squad", "dev-v2.0.json"),
                            ("ccq_ruler_qa_hotpot", "hotpot_dev_distractor_v1.json")):
        for qa_dir in (None, tmp_path):
            with pytest.raises(qa_data.QADataMissingError) as err:
                qa.generate_docs(task, tokenizer="byt5", lengths=[1024], depths=[50],
                                 **({"qa_dir": str(qa_dir)} if qa_dir else {}))
            message = str(err.value)
            assert "\n" not in message and isinstance(err.value, UserError)
            for part in ("--qa-dir DIR", "qa_dir=DIR", file_name, "hub", "HF_HUB_OFFLINE"):
                assert part in message, (part, message)
            if qa_dir:
                assert str(tmp_path) in message


def test_data_file_lookup(tmp_path):
    for task in TASKS:
        assert qa_data.qa_data_present(task, FIXTURES)
        assert qa_data.qa_data_file(task, FIXTURES).parent == FIXTURES
        assert not qa_data.qa_data_present(task, tmp_path) and qa_data.qa_data_file(task, None) is None
        assert not qa_data.qa_data_present(task, tmp_path / "missing")
    # the names RULER's download script saves the files under work too
    shutil.copy(FIXTURES / "dev-v2.0.json", tmp_path / "squad.json")
    assert qa_data.qa_data_file("ccq_ruler_qa_squad", tmp_path) == tmp_path / "squad.json"
    assert not qa_data.qa_data_present("ccq_ruler_qa_hotpot", tmp_path)
    with pytest.raises(qa_data.QAError, match="unknown RULER QA task"):
        qa_data.qa_data_file("ccq_ruler_qa_trivia", FIXTURES)


def test_hub_rows_convert_to_the_official_structure():
    raw = fixture_json("ccq_ruler_qa_squad")
    # the hub's squad_v2 validation rows: one per question, answers as {text: [...], answer_start: [...]}
    rows = [{"id": q["id"], "title": a["title"], "context": p["context"], "question": q["question"],
             "answers": {"text": [x["text"] for x in q["answers"]],
                         "answer_start": [x["answer_start"] for x in q["answers"]]}}
            for a in raw["data"] for p in a["paragraphs"] for q in p["qas"]]
    converted = qa_data.squad_from_rows(rows)
    assert qa_data.read_squad(converted, "hub") == qa_data.read_squad(raw, "file")


def test_bad_file_is_a_user_error(tmp_path):
    (tmp_path / "dev-v2.0.json").write_text(json.dumps({"version": "v2.0", "articles": []}))
    with pytest.raises(qa_data.QAError, match="not a SQuAD v2 file"):
        qa_data.load_qa_data("ccq_ruler_qa_squad", tmp_path)


# ------------------------------------------------------------------ (f) gold document at its depth
def test_gold_documents_sit_at_the_requested_depth(generated):
    for (_, task), docs in generated.items():
        gold = gold_by_question(task)
        for doc in docs:
            gold_texts, answers = gold[doc["question"]]
            assert doc["outputs"] == answers
            documents = prompt_documents(doc["input"])
            n = doc["num_haystack"]
            first = int(n * doc["depth"] / 100) + 1  # gold before distractor int(n * depth / 100)
            assert doc["gold_documents"] == list(range(first, first + len(gold_texts)))
            assert documents[first - 1 : first - 1 + len(gold_texts)] == gold_texts
            assert sum(d in gold_texts for d in documents) == len(gold_texts)  # gold only once
            assert doc["input"][doc["needle_char_offset"]:].startswith(f"Document {first}:\n{gold_texts[0]}")
            if doc["depth"] == 0:
                assert first == 1
            if doc["depth"] == 100:
                assert first + len(gold_texts) - 1 == len(documents)


def test_cells_are_seeded_and_independent_of_the_grid(generated):
    docs = generated[("byt5", "ccq_ruler_qa_squad")]
    alone = qa.generate_docs("ccq_ruler_qa_squad", tokenizer="byt5", qa_dir=str(FIXTURES), lengths=[2048],
                             depths=[50])
    assert alone[0]["input"] == docs[4]["input"]
    other_seed = qa.generate_docs("ccq_ruler_qa_squad", tokenizer="byt5", qa_dir=str(FIXTURES), seed=7, **GRID)
    assert [d["input"] for d in other_seed] != [d["input"] for d in docs]
    for task in TASKS:  # a cell asks the same question whatever the tokenizer (only the sizes differ)
        assert [d["question"] for d in generated[("byt5", task)]] == [
            d["question"] for d in generated[("mistral_v1", task)]]


def test_too_short_length_names_the_minimum():
    with pytest.raises(qa.QAError, match=r"length 256 is too small for ccq_ruler_qa_hotpot .* at least \d+"):
        qa.generate_docs("ccq_ruler_qa_hotpot", tokenizer="byt5", qa_dir=str(FIXTURES), lengths=[256], depths=[0])


# ------------------------------------------------------------------ (e) through lm-eval
@pytest.fixture(scope="module")
def task_manager():
    metadata = {"tokenizer": "byt5", "lengths": [1024, 2048], "depths": [0, 100], "qa_dir": str(FIXTURES)}
    return TaskManager(include_path=str(ROOT / "tasks" / "ruler_qa"), include_defaults=False, metadata=metadata)


def evaluate(task_manager, lm):
    return simple_evaluate(model=lm, tasks=["ccq_ruler_qa"], task_manager=task_manager, log_samples=True,
                           bootstrap_iters=0)


def test_tasks_build_and_score_through_lm_eval(task_manager):
    assert {"ccq_ruler_qa", *TASKS} <= set(task_manager.all_tasks)
    answers = {q: a for task in TASKS for q, (_, a) in gold_by_question(task).items()}

    def knows(prompt: str) -> str:
        return " " + answers[prompt.rsplit("Question: ", 1)[1].removesuffix(" Answer:")][0] + "."

    lm = ScriptedLM(knows)
    out = evaluate(task_manager, lm)
    assert len(lm.requests) == 2 * 4
    for req in lm.requests:
        context, gen_kwargs = req.args
        assert context.endswith(" Answer:")
        assert gen_kwargs == {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": 32}
    for task in TASKS:
        samples = out["samples"][task]
        assert {s["doc"]["input"] for s in samples} == {r.args[0] for r in lm.requests if r.task_name == task}
        assert [(s["doc"]["length"], s["doc"]["depth"]) for s in samples] == [
            (1024, 0), (1024, 100), (2048, 0), (2048, 100)]
        res = out["results"][task]
        assert res["acc,none"] == res["acc_1024,none"] == res["acc_2048,none"] == 100.0
        assert "acc_4096,none" not in res
    assert out["results"]["ccq_ruler_qa"]["acc,none"] == 100.0

    wrong = evaluate(task_manager, ScriptedLM(lambda prompt: " I cannot tell."))
    assert wrong["results"]["ccq_ruler_qa"]["acc,none"] == 0.0
