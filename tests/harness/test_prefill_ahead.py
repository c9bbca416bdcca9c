"""The next batch's prefill beside the current batch's decode (generation.PrefillAhead, on by default
with CUDA graphs): the same answers as one batch after the other, greedy and sampled, each batch but
the first prefilled ahead; an error in a prefill ahead reaches the caller; and on CUDA (marked gpu) the
embedded trained models with their default graphs, prefill ahead against none."""

from __future__ import annotations

import importlib

import pytest
import torch
from adapter_support import byte_tokenizer
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.loading import load_model
from ccq_eval.model.modeling_ccq import CCQGLAConfig, CCQGLAForCausalLM, prepare_runtime

prepare_runtime()
sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")


def _tiny_lm(batch_size: int) -> CCQEvalLM:
    torch.manual_seed(0)
    model = CCQGLAForCausalLM(CCQGLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=384,
                                           ccq_lambda=0.5)).double().eval()
    return CCQEvalLM(model=model, tokenizer=byte_tokenizer(), batch_size=batch_size, chunk_size=16)


def _answers(lm: CCQEvalLM, requests: list[Instance], ahead: bool) -> list[str]:
    lm.generator.prefill_ahead = ahead
    return lm.generate_until(requests, disable_tqdm=True)


@pytest.mark.parametrize("gen_kwargs", [{"until": ["\n"], "max_gen_toks": 12},
                                        {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}])
def test_prefill_ahead_answers_as_one_batch_after_the_other(gen_kwargs):
    lm = _tiny_lm(batch_size=2)
    prompts = ["the cat sat on the mat. " * k for k in (1, 3, 2, 5, 4, 1, 2)]  # 4 batches of up to 2 rows
    requests = [Instance("generate_until", {}, (p, dict(gen_kwargs)), i) for i, p in enumerate(prompts)]
    alone = _answers(lm, requests, ahead=False)
    assert lm.generator.last_prefills_ahead == 0
    assert _answers(lm, requests, ahead=True) == alone
    assert lm.generator.last_prefills_ahead == 3  # every batch after the first
    assert any(text for text in alone)


def test_an_error_in_a_prefill_ahead_reaches_the_caller(monkeypatch):
    lm = _tiny_lm(batch_size=1)
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 4}), i)
                for i, p in enumerate(["first prompt", "second prompt", "third prompt"])]
    calls = []
    prefill = lm.generator._prefill

    def failing_second(prompts):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("prefill failed")
        return prefill(prompts)

    monkeypatch.setattr(lm.generator, "_prefill", failing_second)
    lm.generator.prefill_ahead = True
    with pytest.raises(RuntimeError, match="prefill failed"):
        lm.generate_until(requests, disable_tqdm=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla-ccq", "tiny-gdn-ccq"])
def test_prefill_ahead_answers_as_none_on_cuda(name):
    """bf16, the default CUDA path (graphed decode), batches of 2 rows: the same texts."""
    model, tokenizer = load_model(name, device="cuda", dtype="bfloat16")
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, batch_size=2)
    docs = sn.generate_docs("s_niah_1", tokenizer=name, lengths=[1024], depths=[0, 25, 50, 75, 100],
                            samples_per_cell=1)
    requests = [Instance("generate_until", doc, (doc["input"], {"until": ["\n"], "max_gen_toks": 24}), i)
                for i, doc in enumerate(docs)]
    assert lm.generator.prefill_ahead  # the default with CUDA graphs
    ahead = _answers(lm, requests, ahead=True)
    assert lm.generator.last_prefills_ahead == 2
    assert ahead == _answers(lm, requests, ahead=False)
