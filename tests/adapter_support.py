"""Shared pieces of the adapter tests (tests/harness/test_adapter_*.py): a tiny random causal LM with a
cache (GPT-2 shape, built offline) and byte-level tokenizers with and without a BOS token."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from transformers import ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

REPO = Path(__file__).resolve().parent.parent


def byte_tokenizer(with_bos: bool = False):
    tokenizer = ByT5Tokenizer()
    if with_bos:
        tokenizer.add_special_tokens({"bos_token": "<s>"})
    return tokenizer


def tiny_model(tokenizer, dtype: torch.dtype = torch.float64, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=4096, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return GPT2LMHeadModel(config).to(dtype).eval()


def full_token_nll(model, ids: list[int]) -> torch.Tensor:
    """NLL of tokens 1.. of `ids` from one full forward without a cache (the reference)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].double()
    logprob = logits.log_softmax(-1)[:-1]
    return -logprob.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def greedy_full_recompute(model, ids: list[int], n_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding that re-runs the whole sequence for every token (no cache)."""
    sequence = list(ids)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(n_new):
            token = int(model(torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax())
            if token in stop_ids:
                break
            new.append(token)
            sequence.append(token)
    return new


def ppl_utils():
    """tasks/ppl/utils.py (lm-eval loads it by path; from the repository root it is a package module)."""
    return importlib.import_module("ccq_eval.tasks.ppl.utils")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine makes a second thread
    spin-wait; restored after each test so other test files keep their setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def task_generation_requests(task_names, metadata: dict) -> list:
    """Every document of lm-eval tasks `task_names` (built with our task metadata), as the evaluator would
    request its generation."""
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import get_task_dict

    from ccq_eval.harness.task_registry import make_task_manager

    tasks = get_task_dict(list(task_names), make_task_manager(metadata=metadata))
    requests = []
    for task_name, task in tasks.items():
        kwargs = dict(task.config.generation_kwargs)
        for doc_id, doc in enumerate(task.eval_docs):
            requests.append(Instance("generate_until", doc, (task.doc_to_text(doc), kwargs), len(requests),
                                     metadata=(task_name, doc_id, 1)))
    return requests
