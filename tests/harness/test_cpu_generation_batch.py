"""On the CPU, "auto" decodes a recurrent model's prompts together (batching.CPU_GENERATION_BATCH): the
embedded trained tiny-gla and tiny-gdn, with CCQ attached at lambda 2 too (whose answers run to the full
token budget), give every greedy S-NIAH answer exactly as one prompt at a time does."""

from __future__ import annotations

import importlib

import pytest
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.batching import CPU_GENERATION_BATCH
from ccq_eval.model.loading import load_model

sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")


@pytest.mark.slow
@pytest.mark.parametrize("name,ccq_lambda", [("tiny-gla", None), ("tiny-gdn", 2.0)])
def test_cpu_auto_batch_answers_as_one_prompt_at_a_time(name, ccq_lambda):
    extra = {} if ccq_lambda is None else {"ccq_lambda": ccq_lambda}
    model, tokenizer = load_model(name, device="cpu", dtype="float32", **extra)
    docs = sn.generate_docs("s_niah_1", tokenizer=name, lengths=[1024, 2048], depths=[0, 50, 100],
                            samples_per_cell=1)  # six prompts of about 800 to 1900 tokens
    requests = [Instance("generate_until", doc, (doc["input"], {"until": ["\n"], "max_gen_toks": 16}), i)
                for i, doc in enumerate(docs)]

    auto = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096)
    single = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096, batch_size=1)
    assert auto.batch_size == CPU_GENERATION_BATCH and single.batch_size == 1

    texts = auto.generate_until(requests, disable_tqdm=True)
    assert max(auto.batch_sizes_run) == len(requests)  # all six decoded together
    assert texts == single.generate_until(requests, disable_tqdm=True)
