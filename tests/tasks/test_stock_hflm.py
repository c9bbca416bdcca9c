"""Our task families under lm-eval's stock `hf` model (HFLM), not the ccq adapter: S-NIAH, both perplexity
protocols and a LongBench fixture through lm_eval.simple_evaluate on the embedded tiny-transformer (a plain
transformers Llama), with lm-eval's own TaskManager over the installed task folders."""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path

import ccq_eval.tasks
import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

MODEL = Path(str(importlib.resources.files("ccq_eval.models"))) / "tiny-transformer"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"
TASKS = ["ccq_s_niah_1", "ccq_ppl_buckets", "ccq_ppl_sweep", "ccq_longbench_hotpotqa"]
LENGTH = 1024


@pytest.fixture(scope="module")
def evaluation():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")  # HFLM asks the hub about the model otherwise
        torch.manual_seed(0)
        folder = Path(ccq_eval.tasks.__path__[0])  # what the README's --include_path prints
        metadata = {"tokenizer": str(MODEL), "lengths": [LENGTH], "depths": [50], "samples_per_cell": 1,
                    "bucket_size": 512, "max_blocks": 1, "max_docs_per_length": 1, "data_dir": str(FIXTURES)}
        manager = TaskManager(include_path=[str(folder / name) for name in ("s_niah", "ppl", "longbench")],
                              include_defaults=False, metadata=metadata)
        # add_bos_token=False: HFLM tokenises without special tokens (ByT5 would close each text with </s>)
        model_args = {"pretrained": str(MODEL), "dtype": "float32", "add_bos_token": False}
        return simple_evaluate(model="hf", model_args=model_args,
                               tasks=TASKS, task_manager=manager, limit=1, bootstrap_iters=0, log_samples=True,
                               device="cpu", batch_size=1)


def _finite(results: dict, *metrics: str) -> None:
    for metric in metrics:
        assert math.isfinite(results[f"{metric},none"]), metric


def test_every_family_gives_its_metrics(evaluation):
    results = evaluation["results"]
    _finite(results["ccq_s_niah_1"], "acc", f"acc_{LENGTH}")
    assert 0.0 <= results["ccq_s_niah_1"]["acc,none"] <= 100.0
    _finite(results["ccq_ppl_sweep"], *(f"{name}@{LENGTH}" for name in ("ppl", "nll", "tokens", "docs", "doc_ppl")))
    # one summed log-likelihood per block: the whole block's metrics, no position buckets
    _finite(results["ccq_ppl_buckets"], "ppl", "nll", "tokens")
    assert not [key for key in results["ccq_ppl_buckets"] if key.startswith("ppl@")]
    _finite(results["ccq_longbench_hotpotqa"], "score")
    assert 0.0 <= results["ccq_longbench_hotpotqa"]["score,none"] <= 100.0


def test_generation_requests_carry_only_keys_every_model_takes(evaluation):
    # HFLM hands generation_kwargs to model.generate, which refuses keys it does not know
    for task in ("ccq_s_niah_1", "ccq_longbench_hotpotqa"):
        assert set(evaluation["configs"][task]["generation_kwargs"]) <= {"until", "do_sample", "temperature",
                                                                        "max_gen_toks"}, task
        (sample,) = evaluation["samples"][task]
        assert isinstance(sample["resps"][0][0], str)


@pytest.mark.parametrize("task", ["ccq_ppl_sweep", "ccq_ppl_buckets"])
def test_perplexity_equals_a_direct_forward(evaluation, task):
    # HFLM scores every text token, the first after its EOS prefix (the byte tokenizer has no BOS)
    (sample,) = evaluation["samples"][task]
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tokenizer(sample["doc"]["text"], add_special_tokens=False).input_ids
    assert len(ids) == sample["doc"]["n_text_tokens"]
    inputs = torch.tensor([[tokenizer.eos_token_id, *ids]])
    with torch.no_grad():
        logprobs = model(inputs).logits[0, :-1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, inputs[0, 1:, None]).sum().item()
    results = evaluation["results"][task]
    suffix = f"@{LENGTH}" if task == "ccq_ppl_sweep" else ""
    assert results[f"tokens{suffix},none"] == len(ids)
    assert results[f"nll{suffix},none"] == pytest.approx(nll, rel=1e-5)
    assert results[f"ppl{suffix},none"] == pytest.approx(math.exp(nll / len(ids)), rel=1e-5)
