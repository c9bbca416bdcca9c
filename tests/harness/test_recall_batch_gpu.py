"""On CUDA the recall tasks (generate_until, prompts of up to 2K tokens) take the adapter's batched fast path:
its auto batch answers every document of the six jrt tasks exactly as batch 1 does, on the embedded tiny-gla
and tiny-gdn with CUDA graphs. The prompts, the "\\n" stop and the 48-token budget are the tasks' own, built
through lm-eval's task configs on tests/fixtures/recall. float32, for the reason test_ruler_batch_gpu.py
gives (bf16 tiles differ between a batch and one row, and near-ties of these tiny models then flip)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adapter_support import task_generation_requests

from ccq_eval.harness.task_registry import RECALL_TASKS

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "recall"


def _requests(name: str, mode: str) -> list:
    """Every fixture document of the six recall tasks, as the evaluator would request it."""
    return task_generation_requests(RECALL_TASKS, {"tokenizer": name, "recall_length": 2048, "recall_prompt": mode,
                                                   "recall_dir": str(FIXTURES)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn"])
@pytest.mark.parametrize("mode", ["once", "twice"])
def test_recall_tasks_batched_answer_as_batch_one(name: str, mode: str) -> None:
    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.model.loading import load_model

    model, tokenizer = load_model(name, device="cuda", dtype="float32")
    requests = _requests(name, mode)
    assert {r.task_name for r in requests} == set(RECALL_TASKS)
    assert all(r.args[1]["until"] == ["\n"] and r.args[1]["max_gen_toks"] == 48 for r in requests)

    single = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, batch_size=1)
    auto = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048)
    assert auto.batch_size_auto and auto.cuda_graphs

    batched = auto.generate_until(requests, disable_tqdm=True)
    assert max(auto.batch_sizes_run) > 1  # documents of several tasks decoded together
    one_by_one = single.generate_until(requests, disable_tqdm=True)
    mismatched = [(r.task_name, r.doc.get("row"), a, b)
                  for r, a, b in zip(requests, batched, one_by_one, strict=True) if a != b]
    assert not mismatched, (len(mismatched), len(requests), mismatched[:3])
