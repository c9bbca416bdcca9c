"""The ccq adapter against lm-eval's own HFLM on tiny-transformer (a softmax Llama, float32), on every
request type of the zero-shot suite: the lm-eval Instances that lm-eval's own task configs build from the
fixtures (tests/fixtures/zeroshot), multiple choice, lambada's target, and wikitext's rolling windows.

HFLM is built as the brief of the comparison says, with add_bos_token=False: the embedded models' ByT5
tokenizer appends EOS when asked for special tokens, so HFLM's default would encode every context as
"<text></s>" and split continuations one byte off; without special tokens HFLM encodes as lm-eval <= 0.4.2
did for causal models (the lm-eval of the published tables), and as the adapter does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adapter_support import one_torch_thread  # noqa: F401
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from ccq_eval.harness import zeroshot
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager
from ccq_eval.model.loading import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zeroshot"
WINDOW = 96  # the wikitext fixtures span several windows of this many tokens
TOLERANCE = 1e-4  # float32: log-likelihood sums of up to a few hundred tokens


@pytest.fixture(scope="module")
def suite_requests() -> dict[str, list]:
    """Task -> its lm-eval Instances, built by lm-eval from its own config pointed at the fixtures."""
    loaded = zeroshot.load_tasks(make_task_manager(), list(zeroshot.ZEROSHOT_TASKS), FIXTURES)
    requests = {}
    for name, task in loaded["tasks"].items():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        requests[name] = task.instances
    return requests


@pytest.fixture(scope="module")
def transformer():
    model, tokenizer = load_model("tiny-transformer", device="cpu", dtype="float32")
    return model, tokenizer


def _hflm(model, tokenizer, max_length: int) -> HFLM:
    return HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length, batch_size=4,
                add_bos_token=False)


def _greedy_requests(model, tokenizer, requests: list[Instance], n_tokens: int = 3) -> list[Instance]:
    """lambada-style requests whose continuation is the model's own greedy continuation of the context
    (so that their greedy flag is True)."""
    made = []
    for request in requests:
        ids = tokenizer.encode(request.args[0], add_special_tokens=False)
        with torch.no_grad():
            for _ in range(n_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        continuation = tokenizer.decode(ids[-n_tokens:])
        made.append(Instance("loglikelihood", request.doc, (request.args[0], continuation), 0, ("greedy", 0, 1)))
    return made


@pytest.mark.slow
def test_loglikelihood_equals_hflm_on_every_multiple_choice_and_lambada_request(suite_requests, transformer):
    model, tokenizer = transformer
    hflm = _hflm(model, tokenizer, 2048)
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048)  # batch "auto", contexts shared
    greedy = _greedy_requests(model, tokenizer, suite_requests["lambada_openai"])
    for name, requests in [*suite_requests.items(), ("greedy continuations", greedy)]:
        if requests[0].request_type != "loglikelihood":
            continue
        want = hflm.loglikelihood(requests, disable_tqdm=True)
        got = ours.loglikelihood(requests, disable_tqdm=True)
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=TOLERANCE), name
        assert [g[1] for g in got] == [w[1] for w in want], name
        if requests is greedy:
            assert all(w[1] for w in want)
    assert ours.batch_size > 1 and max(ours.batch_sizes_run) > 1  # batched rows, not one at a time


@pytest.mark.slow
def test_wikitext_rolling_equals_hflm_windows_by_default(suite_requests, transformer):
    """No rolling_windows asked: the suite's wikitext is scored in HFLM's windows (each read afresh), and
    equals HFLM's number; rolling_windows=carry reads the text in one pass and differs."""
    model, tokenizer = transformer
    requests = suite_requests["wikitext"]
    assert requests[0].request_type == "loglikelihood_rolling"
    want = _hflm(model, tokenizer, WINDOW).loglikelihood_rolling(requests, disable_tqdm=True)
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, window_tokens=WINDOW)
    got = ours.loglikelihood_rolling(requests, disable_tqdm=True)
    assert [float(g) for g in got] == pytest.approx(want, abs=TOLERANCE)
    assert ours.rolling_protocols == {"wikitext": "hflm"}
    assert ours.get_model_info()["ccq_scoring"]["rolling_protocol_by_task"] == {"wikitext": "hflm"}
    # every token of the text scored once (HFLM's first window predicts the first token from EOS)
    assert [g.n_tokens for g in got] == [len(tokenizer.encode(r.args[0], add_special_tokens=False)) for r in requests]
    carried = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, window_tokens=WINDOW,
                        rolling_windows="carry").loglikelihood_rolling(requests, disable_tqdm=True)
    assert all(abs(float(c) - w) > 1.0 for c, w in zip(carried, want, strict=True))


def test_default_window_is_hflm_max_length(transformer):
    """Without window_tokens the windows are what HFLM resolves as its max_length for the model (the
    config's 2048 here), not the adapter's max_length."""
    model, tokenizer = transformer
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1, add_bos_token=False)
    ours = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=20480)
    assert ours.scorer.window_tokens == hflm.max_length == 2048


@pytest.mark.parametrize("value", ["windows", "HFLM"])
def test_unknown_rolling_protocol_is_refused(transformer, value):
    model, tokenizer = transformer
    with pytest.raises(ValueError, match="rolling_windows must be one of hflm, carry"):
        CCQEvalLM(model=model, tokenizer=tokenizer, rolling_windows=value)


def test_model_info_names_the_wikitext_protocol_before_any_request(transformer):
    """The results say which protocol scores wikitext from the settings alone when one was asked (as the runner
    asks for wikitext's units), also where a resumed run scored none of its requests in this process; asked
    none, the adapter names no protocol it has not used."""
    model, tokenizer = transformer
    for asked, recorded in ((None, {}), ("carry", {"wikitext": "carry"}), ("hflm", {"wikitext": "hflm"})):
        info = CCQEvalLM(model=model, tokenizer=tokenizer, rolling_windows=asked).get_model_info()["ccq_scoring"]
        assert info["rolling_protocol_by_task"] == recorded
        assert info["rolling_windows"] == (asked or "per task") and info["window_tokens"] == 2048
