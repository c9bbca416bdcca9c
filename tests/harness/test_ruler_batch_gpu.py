"""On CUDA the RULER tasks take S-NIAH's fast generation path: the adapter's auto batch answers every prompt
of every synthetic RULER task exactly as batch 1 does, on the embedded tiny-gla and tiny-gdn with CUDA
graphs. The prompts, stop strings and budgets are the tasks' own, built through lm-eval's task configs,
so a task whose generation settings the fast path mishandles fails here. float32: in bf16 a batch's
matrix products take other kernel tiles than one row's, and over the tasks' budgets of up to 128 greedy
tokens a near-tie between two tokens of these tiny models then flips now and then (seen: 1 to 2 of 40
answers), which would hide a real batching error behind rounding."""

from __future__ import annotations

import pytest
import torch
from adapter_support import task_generation_requests

from ccq_eval.harness.task_registry import RULER_SYNTHETIC_TASKS


def _requests(name: str) -> list:
    """Every document of the synthetic RULER tasks at 1K and 2K, as the evaluator would request it."""
    return task_generation_requests(RULER_SYNTHETIC_TASKS, {"tokenizer": name, "lengths": [1024, 2048],
                                                            "depths": [0, 100], "samples_per_cell": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn"])
def test_ruler_tasks_batched_answer_as_batch_one(name: str) -> None:
    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.model.loading import load_model

    model, tokenizer = load_model(name, device="cuda", dtype="float32")
    requests = _requests(name)
    assert {r.task_name for r in requests} == set(RULER_SYNTHETIC_TASKS)

    single = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096, batch_size=1)
    auto = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096)
    assert auto.batch_size_auto and auto.cuda_graphs

    batched = auto.generate_until(requests, disable_tqdm=True)
    assert max(auto.batch_sizes_run) > 1  # prompts of several tasks and lengths decoded together
    one_by_one = single.generate_until(requests, disable_tqdm=True)
    mismatched = [(r.task_name, r.doc.get("length"), a, b)
                  for r, a, b in zip(requests, batched, one_by_one, strict=True) if a != b]
    assert not mismatched, (len(mismatched), len(requests), mismatched[:3])
