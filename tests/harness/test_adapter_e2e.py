"""The S-NIAH and LongBench families through lm_eval.simple_evaluate with the ccq adapter and a tiny
random model: finite, correctly shaped results, and the truncation record the runner stores."""

from __future__ import annotations

import math
from pathlib import Path

from adapter_support import byte_tokenizer, one_torch_thread, tiny_model  # noqa: F401
from lm_eval import simple_evaluate

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager, resolve_tasks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"


def test_s_niah_family_end_to_end() -> None:
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer, dtype=torch_float32()), tokenizer=tokenizer, max_length=1024,
                   batch_size=2)
    tasks = resolve_tasks(["s-niah"])
    assert tasks == ["ccq_s_niah_1", "ccq_s_niah_2", "ccq_s_niah_3"]
    metadata = {"tokenizer": "byt5", "lengths": [1024], "depths": [50], "samples_per_cell": 1}
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=make_task_manager(metadata), bootstrap_iters=0,
                          log_samples=True)
    for task in tasks:
        result = out["results"][task]
        assert 0.0 <= result["acc,none"] <= 100.0 and math.isfinite(result["acc_1024,none"])
        assert len(out["samples"][task]) == 1  # one (length, depth) cell, one sample
        for sample in out["samples"][task]:
            assert isinstance(sample["resps"][0][0], str)
    # S-NIAH prompts are sized to fit: policy "error", nothing cut
    assert lm.truncation_policy_counts == {"error": 3} and lm.n_truncated == 0


def test_longbench_family_end_to_end() -> None:
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer, dtype=torch_float32()), tokenizer=tokenizer, max_length=300)
    assert len(resolve_tasks(["longbench"])) == 21 and len(resolve_tasks(["longbench-e"])) == 13
    tasks = ["ccq_longbench_trec", "ccq_longbench_e_passage_count"]
    out = simple_evaluate(model=lm, tasks=tasks, task_manager=make_task_manager({"data_dir": str(FIXTURES)}),
                          bootstrap_iters=0, log_samples=True)
    assert 0.0 <= out["results"]["ccq_longbench_trec"]["score,none"] <= 100.0
    for bucket in ("score,none", "score_0-4k,none", "score_4-8k,none", "score_8k+,none"):
        assert 0.0 <= out["results"]["ccq_longbench_e_passage_count"][bucket] <= 100.0
    # the prompts exceed 300 - max_gen_toks tokens: the tasks' middle policy applied and counted
    n_requests = len(out["samples"]["ccq_longbench_trec"]) + len(out["samples"]["ccq_longbench_e_passage_count"])
    assert lm.truncation_policy_counts == {"middle": n_requests}
    assert 0 < lm.n_truncated <= n_requests


def torch_float32():
    import torch

    return torch.float32
