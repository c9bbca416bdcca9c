"""S-NIAH through lm-eval: task loading with metadata, requests, and scoring/aggregation end to
end with dummy models (one that retrieves the needle from the prompt, one that answers garbage,
one that is right only at the shorter length)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from scripted_lm import ScriptedLM

ROOT = Path(__file__).resolve().parents[2]
METADATA = {"tokenizer": "byt5", "lengths": [1024, 2048], "depths": [0, 50, 100], "samples_per_cell": 1}
TASKS = ("ccq_s_niah_1", "ccq_s_niah_2", "ccq_s_niah_3")

QUESTION = re.compile(r"What is the special magic (?:number|uuid) for (\S+) mentioned in the provided text\?")


def read_needle(prompt: str) -> str:
    """What a perfect retriever answers: the value of the needle whose key the question asks about."""
    key = QUESTION.search(prompt).group(1)
    return re.search(rf"One of the special magic (?:numbers|uuids) for {re.escape(key)} is: (\S+)\.", prompt).group(1)


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(ROOT / "tasks/s_niah"), include_defaults=False, metadata=METADATA)


def run(task_manager, lm):
    return simple_evaluate(model=lm, tasks=["ccq_s_niah"], task_manager=task_manager, log_samples=True,
                           bootstrap_iters=0)


def test_tasks_load_with_metadata(task_manager):
    assert {"ccq_s_niah", *TASKS} <= set(task_manager.all_tasks)
    loaded = task_manager.load(["ccq_s_niah"])
    assert set(loaded["tasks"]) == set(TASKS)
    for name in TASKS:
        docs = list(loaded["tasks"][name].test_docs())
        assert [(d["length"], d["depth"]) for d in docs] == [(n, d) for n in (1024, 2048) for d in (0, 50, 100)]
        assert all(d["prompt_tokens"] + 128 <= d["length"] for d in docs)


@pytest.fixture(scope="module")
def gold_run(task_manager):
    lm = ScriptedLM(lambda prompt: f" {read_needle(prompt)}.")
    return lm, run(task_manager, lm)


def test_requests_are_the_prompts_with_ruler_generation_settings(gold_run):
    lm, out = gold_run
    assert len(lm.requests) == 3 * 6
    prompts = {sample["doc"]["input"] for task in TASKS for sample in out["samples"][task]}
    for req in lm.requests:
        context, gen_kwargs = req.args
        assert context in prompts  # the doc's prompt, answer prefix included, sent unchanged
        assert context.endswith("mentioned in the provided text is")
        assert gen_kwargs["max_gen_toks"] == 128 and gen_kwargs["do_sample"] is False
        assert gen_kwargs == {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": 128}


def test_perfect_retriever_scores_100_everywhere(gold_run):
    _, out = gold_run
    for name in TASKS:
        res = out["results"][name]
        assert res["acc,none"] == 100.0 and res["acc_1024,none"] == 100.0 and res["acc_2048,none"] == 100.0
        assert "acc_4096,none" not in res  # only the lengths that were run are reported
    assert out["results"]["ccq_s_niah"]["acc,none"] == 100.0


def test_garbage_scores_0(task_manager):
    out = run(task_manager, ScriptedLM(lambda prompt: " I do not know. 0000000"))
    for name in TASKS:
        assert out["results"][name]["acc,none"] == 0.0
    assert out["results"]["ccq_s_niah"]["acc,none"] == 0.0


def test_per_length_and_per_cell_aggregation(task_manager):
    # right only on the short prompts (1024-token grid, < 1000 bytes with the byte tokenizer),
    # and only at depth 0 on S-NIAH-1 (needle on the first line)
    def answer(prompt: str) -> str:
        if len(prompt.encode()) > 1000:
            return " 1234567."
        if "afterwards.\nOne of the special magic numbers" in prompt or "uuid" in prompt or "\n " in prompt:
            return f" {read_needle(prompt)}."
        return " 7654321."

    out = run(task_manager, ScriptedLM(answer))
    res1, res2 = out["results"]["ccq_s_niah_1"], out["results"]["ccq_s_niah_2"]
    assert res1["acc_1024,none"] == pytest.approx(100 / 3) and res1["acc_2048,none"] == 0.0
    assert res1["acc,none"] == pytest.approx(100 / 6)
    # S-NIAH-2 at depth 0 starts the context with a space (RULER's join): "\n One of ..."
    assert res2["acc_1024,none"] == pytest.approx(100 / 3)
    assert out["results"]["ccq_s_niah_3"]["acc_1024,none"] == 100.0
    assert out["results"]["ccq_s_niah_3"]["acc,none"] == 50.0
    group = out["results"]["ccq_s_niah"]["acc,none"]
    assert group == pytest.approx((100 / 6 + 100 / 6 + 50) / 3)

    # per (length, depth) cells from the per-sample log
    cells = defaultdict(list)
    for sample in out["samples"]["ccq_s_niah_1"]:
        cells[(sample["doc"]["length"], sample["doc"]["depth"])].append(sample["acc"])
    assert dict(cells) == {
        (1024, 0): [100.0], (1024, 50): [0.0], (1024, 100): [0.0],
        (2048, 0): [0.0], (2048, 50): [0.0], (2048, 100): [0.0],
    }
