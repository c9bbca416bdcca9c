"""Prompts of different lengths in one generate batch with the adapter's shared_prefill
(generation.Generator._prefill): prefilled together up to the shortest prompt, the longer prompts' last
tokens fed through the decode steps. In float64 on the CPU backend this answers every prompt as
prefilling each alone does, greedy and sampled; a spread wider than FORCED_TOKENS_PER_ROW per row falls
back to one prefill per prompt."""

from __future__ import annotations

import importlib

import pytest
import torch
from lm_eval.api.instance import Instance

from ccq_eval.harness import generation
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.loading import load_model

sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")


def _adapter(name: str, device: str = "cpu", **extra) -> CCQEvalLM:
    model, tokenizer = load_model(name, device=device, dtype="float64" if device == "cpu" else "float32", **extra)
    return CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, batch_size=8)


def _requests(name: str, gen_kwargs: dict) -> list[Instance]:
    docs = sn.generate_docs("s_niah_1", tokenizer=name, lengths=[1024], depths=[0, 25, 50, 75, 100],
                            samples_per_cell=1)
    return [Instance("generate_until", doc, (doc["input"], dict(gen_kwargs)), i) for i, doc in enumerate(docs)]


def _answers(lm: CCQEvalLM, requests: list[Instance], shared: bool, monkeypatch) -> tuple[list[str], int]:
    """The answers, and how many scorer passes the prefill took."""
    lm.generator.shared_prefill = shared
    passes = []
    run = lm.scorer.run
    monkeypatch.setattr(lm.scorer, "run", lambda *args, **kwargs: passes.append(1) or run(*args, **kwargs))
    answers = lm.generate_until(requests, disable_tqdm=True)
    monkeypatch.setattr(lm.scorer, "run", run)
    return answers, len(passes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn-ccq"])
def test_shared_prefill_answers_as_one_prefill_per_prompt(name, monkeypatch):
    _check_shared_prefill(name, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn", "tiny-gla-ccq", "tiny-gdn-ccq"])
def test_shared_prefill_answers_as_one_prefill_per_prompt_cuda(name, monkeypatch):
    """On CUDA in float32 (fla's chunk kernels for the shared prefill, its recurrent ones and the decode
    graph for the fed tokens), trained weights: the same answers."""
    _check_shared_prefill(name, "cuda", monkeypatch)


def _check_shared_prefill(name: str, device: str, monkeypatch) -> None:
    monkeypatch.setattr(generation, "FORCED_TOKENS_PER_ROW", 64)  # these prompts differ by up to 90 tokens
    lm = _adapter(name, device)
    for gen_kwargs in ({"until": ["\n"], "max_gen_toks": 24},
                       {"until": [], "max_gen_toks": 24, "do_sample": True, "temperature": 1.0}):
        requests = _requests(name, gen_kwargs)
        lengths = {len(lm.tok_encode(r.args[0])) for r in requests}
        assert len(lengths) > 1, "the prompts must differ in length"
        shared, shared_passes = _answers(lm, requests, True, monkeypatch)
        alone, alone_passes = _answers(lm, requests, False, monkeypatch)
        assert shared == alone, gen_kwargs
        assert (shared_passes, alone_passes) == (1, len(requests))
        assert any(text.strip() for text in shared)


def test_shared_prefill_is_asked_for_not_the_default():
    """Off, a row's prompt runs on batch 1's kernels whatever else its batch holds."""
    assert not _adapter("tiny-gla").generator.shared_prefill
    model, tokenizer = load_model("tiny-gla", device="cpu")
    assert CCQEvalLM(model=model, tokenizer=tokenizer, shared_prefill="true").generator.shared_prefill


def test_prefill_groups_keep_the_spread_within_the_allowance():
    per_row = generation.FORCED_TOKENS_PER_ROW
    assert generation.prefill_groups([120, 118, 60, 60, 20]) == [[0, 1], [2, 3], [4]]
    assert generation.prefill_groups([100] * 5) == [[0, 1, 2, 3, 4]]
    assert generation.prefill_groups([100, 100 - 2 * per_row, 100 - 3 * per_row]) == [[0, 1, 2]]
    assert generation.prefill_groups([100, 100 - 2 * per_row - 1]) == [[0], [1]]
    assert generation.prefill_groups([7]) == [[0]]


@pytest.mark.slow
def test_mixed_lengths_in_groups_answer_as_one_prefill_per_prompt(monkeypatch):
    """Runs of near lengths share a prefill, the others go alone; every answer is as alone (float64)."""
    lm = _adapter("tiny-gla")
    texts = ["The key is " + "x" * 90, "The key is " + "y" * 86, "A note: " + "z" * 40, "A note: " + "w" * 40, "Hi"]
    requests = [Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 12}), i)
                for i, text in enumerate(texts)]
    shared, shared_passes = _answers(lm, requests, True, monkeypatch)
    alone, alone_passes = _answers(lm, requests, False, monkeypatch)
    assert shared == alone
    assert (shared_passes, alone_passes) == (3, 5)


def test_a_wide_spread_of_lengths_is_prefilled_one_by_one(monkeypatch):
    lm = _adapter("tiny-gla")
    short, long = "a" * 40, "b" * (40 + generation.FORCED_TOKENS_PER_ROW * 2 + 1)  # byte-level: 1 token a char
    requests = [Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 3}), i)
                for i, text in enumerate((short, long))]
    _, passes = _answers(lm, requests, True, monkeypatch)
    assert passes == 2
    requests[1] = Instance("generate_until", {}, ("b" * (40 + generation.FORCED_TOKENS_PER_ROW * 2), {
        "until": [], "max_gen_toks": 3}), 1)
    _, passes = _answers(lm, requests, True, monkeypatch)
    assert passes == 1 and lm.last_decode_steps == generation.FORCED_TOKENS_PER_ROW * 2 + 2
