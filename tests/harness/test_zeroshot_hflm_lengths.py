"""The zero-shot suite at lm-eval HFLM's lengths, against lm-eval's own HFLM on tiny-transformer (a softmax
Llama, float32): loglikelihood contexts longer than the max length cut from the left as HFLM cuts them
(default_truncation="left"), wikitext read in one pass scoring every token (the `carry` protocol), and the
protocol each adapter records. Requests are the ones lm-eval's own task configs build from the fixtures
(tests/fixtures/zeroshot); HFLM is built with add_bos_token=False, as in test_zeroshot_hflm_parity.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from adapter_support import full_token_nll, one_torch_thread  # noqa: F401
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from ccq_eval.harness import zeroshot
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager
from ccq_eval.model.loading import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zeroshot"
TOLERANCE = 1e-4  # float32: log-likelihood sums of up to a few hundred tokens
PAGE_TOLERANCE = 1e-6  # relative: HFLM sums a page's ~900 log-probabilities in float32 (~1e-4 absolute)
CONTEXT_KEPT = 16  # the max length: the task's longest continuation and this many tokens of context
CUT_TASKS = ("sciq", "piqa", "hellaswag", "lambada_openai")  # long supports, goals, endings; lambada's target


@pytest.fixture(scope="module")
def transformer():
    return load_model("tiny-transformer", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def requests_of() -> dict[str, list[Instance]]:
    """Task -> its lm-eval Instances, built by lm-eval from its own config pointed at the fixtures."""
    names = [*CUT_TASKS, "wikitext"]
    loaded = zeroshot.load_tasks(make_task_manager(), names, FIXTURES)
    built = {}
    for name, task in loaded["tasks"].items():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        built[name] = task.instances
    return built


def _hflm(model, tokenizer, max_length: int | None = None) -> HFLM:
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length, batch_size=4,
                add_bos_token=False)


def _lengths(tokenizer, request: Instance) -> tuple[int, int]:
    """(tokens of the continuation, of context and continuation) as HFLM encodes the pair: the context's
    trailing spaces move to the continuation; an empty context is one EOS."""
    context, continuation = request.args
    whole = len(tokenizer.encode(context + continuation, add_special_tokens=False))
    context_tokens = len(tokenizer.encode(context.rstrip(), add_special_tokens=False)) if context else 1
    return whole - (context_tokens if context else 0), whole + (0 if context else 1)


@pytest.mark.parametrize("task", CUT_TASKS)
def test_contexts_over_the_max_length_are_cut_as_hflm_cuts_them(transformer, requests_of, task):
    model, tokenizer = transformer
    requests = requests_of[task]
    lengths = [_lengths(tokenizer, r) for r in requests]
    max_length = max(n for n, _ in lengths) + CONTEXT_KEPT
    cut = sum(whole > max_length + 1 for _, whole in lengths)  # HFLM keeps max_length + 1 tokens of a row
    assert cut > 0, f"{task}: max_length {max_length} cuts none of its requests"
    want = _hflm(model, tokenizer, max_length).loglikelihood(requests, disable_tqdm=True)
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=max_length, default_truncation="left")
    got = ours.loglikelihood(requests, disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=TOLERANCE)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert ours.truncation_by_task == {task: {"policy": "left", "n_requests": len(requests), "n_truncated": cut}}
    info = ours.get_model_info()["ccq_scoring"]
    assert (info["max_length"], info["loglikelihood_truncation"]) == (max_length, "left")


def test_a_continuation_longer_than_the_max_length_is_one_line(transformer, requests_of):
    model, tokenizer = transformer
    request = requests_of["sciq"][0]
    n_tokens, _ = _lengths(tokenizer, request)
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=n_tokens - 1, default_truncation="left")
    message = (f"task sciq: a continuation of {n_tokens} tokens (doc 0) is longer than max_length {n_tokens - 1}; "
               f"raise --max-length (model_args max_length=...) to at least {n_tokens}")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ours.loglikelihood([request], disable_tqdm=True)


def test_carry_scores_every_token_of_a_wikitext_page(transformer, requests_of):
    """`carry` reads each page in one pass from EOS, as HFLM's first window does: every token is scored, so the
    log-likelihood covers what word_perplexity divides by (the page's words). A page shorter than HFLM's
    window is one window, so there the two protocols give one number."""
    model, tokenizer = transformer
    requests = requests_of["wikitext"]
    ids = [tokenizer.encode(r.args[0], add_special_tokens=False) for r in requests]
    assert max(map(len, ids)) < 2048  # one HFLM window each
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, rolling_windows="carry")
    got = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    assert [g.n_tokens for g in got] == [len(i) for i in ids]
    one_pass = [-float(full_token_nll(model, [tokenizer.eos_token_id, *i]).sum()) for i in ids]
    assert [float(g) for g in got] == pytest.approx(one_pass, abs=TOLERANCE)
    want = _hflm(model, tokenizer).loglikelihood_rolling(requests, disable_tqdm=True)
    assert [float(g) for g in got] == pytest.approx(want, rel=PAGE_TOLERANCE)
    assert ours.get_model_info()["ccq_scoring"]["rolling_protocol_by_task"] == {"wikitext": "carry"}


def test_an_adapter_asked_no_protocol_records_the_one_it_used(transformer, requests_of):
    """The runner asks a protocol for wikitext's units only: an adapter asked none (a copa unit of a carry run)
    names none until it scores a rolling task, and then that task's (test_zeroshot_hflm_parity.py checks the
    adapters asked one)."""
    model, tokenizer = transformer
    ours = CCQEvalLM(model=model, tokenizer=tokenizer)
    assert ours.get_model_info()["ccq_scoring"]["rolling_protocol_by_task"] == {}
    ours.loglikelihood_rolling(requests_of["wikitext"], disable_tqdm=True)
    assert ours.get_model_info()["ccq_scoring"]["rolling_protocol_by_task"] == {"wikitext": "hflm"}
