"""The ccq lm-eval adapter against references computed directly from the model's logits."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from adapter_support import (  # noqa: F401
    byte_tokenizer,
    full_token_nll,
    greedy_full_recompute,
    one_torch_thread,
    tiny_model,
)
from lm_eval.api.instance import Instance
from lm_eval.api.model import CachingLM
from lm_eval.api.registry import get_model

from ccq_eval.harness.adapter import DEFAULT_MAX_LENGTH, CCQEvalLM, TokenNLL

TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
        "of foolishness, it was the epoch of belief, it was the epoch of incredulity.")


def _request(kind: str, args: tuple, task: str = "t", doc_id: int = 0) -> Instance:
    return Instance(kind, {}, args, 0, metadata=(task, doc_id, 1))


@pytest.mark.parametrize("with_bos", [False, True])
@pytest.mark.parametrize("chunk_size", [7, 50, 1000])
def test_rolling_equals_one_full_forward(with_bos: bool, chunk_size: int) -> None:
    tokenizer = byte_tokenizer(with_bos)
    model = tiny_model(tokenizer)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, chunk_size=chunk_size)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(text_ids) % chunk_size != 0  # chunks that do not divide the length

    (value,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (TEXT,))])

    input_ids = ([tokenizer.bos_token_id] if with_bos else []) + text_ids
    reference = full_token_nll(model, input_ids)
    # BOS is unscored context; without one the first text token is.
    assert value.n_tokens == (len(text_ids) if with_bos else len(text_ids) - 1)
    assert torch.allclose(torch.tensor(value.token_nll, dtype=torch.float64), reference, atol=1e-9, rtol=0)
    assert float(value) == pytest.approx(-float(reference.sum()), abs=1e-8)


def test_rolling_fp32_model_within_fp32_tolerance() -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer, dtype=torch.float32)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, chunk_size=33)
    (value,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (TEXT,))])
    reference = full_token_nll(model, tokenizer.encode(TEXT, add_special_tokens=False))
    assert torch.allclose(torch.tensor(value.token_nll, dtype=torch.float64), reference, atol=1e-4, rtol=1e-5)


def test_batched_rolling_equals_one_at_a_time() -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    texts = [TEXT[:90], TEXT[10:100], TEXT[:40], TEXT[20:110], TEXT[5:45]]  # two length groups + one
    requests = [_request("loglikelihood_rolling", (text,), doc_id=i) for i, text in enumerate(texts)]
    batched = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=4, chunk_size=16).loglikelihood_rolling(requests)
    single = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, chunk_size=16).loglikelihood_rolling(requests)
    for a, b in zip(batched, single, strict=True):
        assert a.token_nll == pytest.approx(b.token_nll, abs=1e-9)


def test_token_nll_pickles_and_serialises_as_its_sum() -> None:
    value = TokenNLL(-3.5, [1.0, 2.5])
    assert float(value) == -3.5 and value.token_nll == [1.0, 2.5]
    restored = pickle.loads(pickle.dumps(value))
    assert isinstance(restored, TokenNLL) and restored.token_nll == [1.0, 2.5] and float(restored) == -3.5
    assert json.loads(json.dumps({"r": value})) == {"r": -3.5}
    assert float(TokenNLL.from_token_nll([0.25, 0.5])) == -0.75
    with pytest.raises(ValueError, match="sum"):
        TokenNLL(-1.0, [0.25, 0.5])


def test_loglikelihood_equals_reference_sums_and_greedy_flag() -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=3, chunk_size=9)
    prompt = "The answer is"
    greedy = tokenizer.decode(greedy_full_recompute(model, tokenizer.encode(prompt, add_special_tokens=False),
                                                    6, stop_ids=set()))
    pairs = [(prompt, " forty-two"), (prompt + " ", "forty-two"), (prompt, greedy), ("", "forty-two"),
             ("Some other context", " here")]
    results = lm.loglikelihood([_request("loglikelihood", pair, doc_id=i) for i, pair in enumerate(pairs)])

    def reference(context: str, continuation: str) -> float:
        context_ids = tokenizer.encode(context.rstrip(" "), add_special_tokens=False) if context else [
            tokenizer.eos_token_id]  # no BOS: an empty context is scored after EOS
        moved = context[len(context.rstrip(" ")):] if context else ""
        continuation_ids = tokenizer.encode(moved + continuation, add_special_tokens=False)
        nll = full_token_nll(model, context_ids + continuation_ids)
        return -float(nll[-len(continuation_ids):].sum())

    for (context, continuation), (logprob, _) in zip(pairs, results, strict=True):
        assert logprob == pytest.approx(reference(context, continuation), abs=1e-8)
    # the trailing space moves to the continuation: both spellings score the same tokens
    assert results[0][0] == pytest.approx(results[1][0], abs=1e-10)
    assert results[2][1] is True and results[0][1] is False


def test_default_max_length_is_not_the_config_value() -> None:
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer)
    assert lm.max_length == DEFAULT_MAX_LENGTH != 4096  # the config's n_positions
    assert CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer, max_length="20480").max_length == 20480


@pytest.mark.parametrize("with_bos", [False, True])
def test_generation_equals_greedy_full_recompute(with_bos: bool) -> None:
    tokenizer = byte_tokenizer(with_bos)
    model = tiny_model(tokenizer)
    prompts = ["Once upon a time", "Twice upon a tim", "A b", TEXT]  # two of equal length: batched
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=2, chunk_size=8)
    requests = [_request("generate_until", (p, {"until": [], "max_gen_toks": 12, "do_sample": False}), doc_id=i)
                for i, p in enumerate(prompts)]
    outputs = lm.generate_until(requests)
    prefix = [tokenizer.bos_token_id] if with_bos else []
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = prefix + tokenizer.encode(prompt, add_special_tokens=False)
        expected = greedy_full_recompute(model, ids, 12, stop_ids={tokenizer.eos_token_id})
        assert output == tokenizer.decode(expected, skip_special_tokens=True)


def test_generation_stops_at_until_string() -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer)
    prompt = "Once upon a time"
    full = lm.generate_until([_request("generate_until", (prompt, {"until": [], "max_gen_toks": 10}))])[0]
    assert len(full) >= 4
    stop = full[3]
    cut = lm.generate_until([_request("generate_until", (prompt, {"until": [stop], "max_gen_toks": 10}))])[0]
    assert cut == full[: full.index(stop)]


def test_truncation_policies() -> None:
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    long_prompt = TEXT  # about 150 byte tokens
    settings = {"until": [], "max_gen_toks": 8}

    strict = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=48)
    with pytest.raises(ValueError, match="does not fit"):
        strict.generate_until([_request("generate_until", (long_prompt, dict(settings)))])
    with pytest.raises(ValueError, match="valid"):
        strict.generate_until([_request("generate_until", (long_prompt, {**settings, "ccq_truncation": "cut"}))])

    lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=48)
    short = "short prompt"
    outputs = lm.generate_until([
        _request("generate_until", (long_prompt, {**settings, "ccq_truncation": "middle"}), task="lb"),
        _request("generate_until", (short, {**settings, "ccq_truncation": "middle"}), task="lb", doc_id=1),
        _request("generate_until", (long_prompt, {**settings, "ccq_truncation": "left"}), task="other"),
    ])
    assert lm.n_truncated == 2
    assert lm.truncation_policy_counts == {"middle": 2, "left": 1}
    assert lm.truncation_stats["by_task"]["lb"] == {"policy": "middle", "n_requests": 2, "n_truncated": 1}

    # The middle-truncated prompt is the first and last 20 of 40 budget tokens; generating from
    # it without truncation gives the same text.
    ids = tokenizer.encode(long_prompt, add_special_tokens=False)
    budget = 48 - 8
    middle = tokenizer.decode(ids[: budget // 2] + ids[-(budget // 2):])
    left = tokenizer.decode(ids[-budget:])
    roomy = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096)
    expected = roomy.generate_until([_request("generate_until", (middle, dict(settings))),
                                     _request("generate_until", (short, dict(settings))),
                                     _request("generate_until", (left, dict(settings)))])
    assert outputs == expected
    assert roomy.n_truncated == 0


def test_truncation_policy_from_the_task_metadata() -> None:
    # Our task YAMLs name the policy in their metadata (S-NIAH error, LongBench middle), not in the
    # generation_kwargs every lm-eval model receives; a request's own ccq_truncation still wins.
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer, max_length=48)
    settings = {"until": [], "max_gen_toks": 8}
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cut = lm.generate_until([_request("generate_until", (TEXT, dict(settings)), task="ccq_longbench_qasper")])
    whole = lm.generate_until([_request("generate_until", (tokenizer.decode(ids[:20] + ids[-20:]),
                                                           dict(settings)), task="t")])
    assert cut == whole
    assert lm.truncation_stats["by_task"]["ccq_longbench_qasper"] == {"policy": "middle", "n_requests": 1,
                                                                      "n_truncated": 1}
    with pytest.raises(ValueError, match=r"task ccq_s_niah_1: prompt of .* does not fit"):
        lm.generate_until([_request("generate_until", (TEXT, dict(settings)), task="ccq_s_niah_1")])
    left = lm.generate_until([_request("generate_until", (TEXT, {**settings, "ccq_truncation": "left"}),
                                       task="ccq_s_niah_1")])
    assert left == lm.generate_until([_request("generate_until", (tokenizer.decode(ids[-40:]), dict(settings)))])


def test_unsupported_generation_kwargs_are_errors() -> None:
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="repetition_penalty"):
        lm.generate_until([_request("generate_until", ("x", {"repetition_penalty": 1.2}))])


def test_response_cache_returns_token_nll(tmp_path) -> None:
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer, chunk_size=16)
    requests = [_request("loglikelihood_rolling", (TEXT,)), _request("loglikelihood_rolling", (TEXT[:50],))]
    first = CachingLM(lm, str(tmp_path / "cache.db")).loglikelihood_rolling(requests)

    calls = []
    lm.loglikelihood_rolling = lambda reqs: calls.append(reqs) or []  # must not be reached
    second = CachingLM(lm, str(tmp_path / "cache.db")).loglikelihood_rolling(requests)
    assert not calls
    for a, b in zip(first, second, strict=True):
        assert isinstance(b, TokenNLL) and b.token_nll == a.token_nll and float(b) == float(a)


def test_registered_by_name_loads_through_ccq_loading(monkeypatch) -> None:
    import ccq_eval.model.loading

    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    seen = {}

    def fake_load_model(name, *, device="cpu", dtype=None, allow_pickle=False, trust_remote_code=False):
        seen.update(name=name, device=device, dtype=dtype, allow_pickle=allow_pickle)
        return model, tokenizer

    monkeypatch.setattr(ccq_eval.model.loading, "load_model", fake_load_model)
    lm = get_model("ccq").create_from_arg_string(
        "pretrained=tiny-test,max_length=300,dtype=float64,chunk_size=64",
        {"batch_size": 2, "max_batch_size": None, "device": "cpu"})
    assert isinstance(lm, CCQEvalLM)
    assert seen == {"name": "tiny-test", "device": "cpu", "dtype": "float64", "allow_pickle": False}
    assert (lm.max_length, lm.batch_size, lm.chunk_size) == (300, 2, 64)
    (value,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", (TEXT,))])
    assert math.isfinite(float(value))


def test_generation_stops_at_a_late_stop_string_of_several_tokens() -> None:
    # The per-step stop check decodes each row's recent tokens only: a stop string of several tokens that
    # first appears late still ends the answer there, and decoding stops with it (not at max_gen_toks).
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer, seed=1)  # its answer changes character after about 30 tokens
    lm = CCQEvalLM(model=model, tokenizer=tokenizer)
    prompt = "Once upon a time"
    full = lm.generate_until([_request("generate_until", (prompt, {"until": [], "max_gen_toks": 80}))])[0]
    assert lm.last_decode_steps == 79 and full.isascii()
    # a 4-character stop first seen well past the 16 tokens that the check decodes
    at = max(i for i in range(len(full) - 4) if full.index(full[i:i + 4]) == i)
    assert at >= 20
    stop = full[at:at + 4]
    cut = lm.generate_until([_request("generate_until", (prompt, {"until": ["zzz", stop], "max_gen_toks": 80}))])[0]
    assert cut == full[:at]
    assert lm.last_decode_steps == at + 3  # the stop's last token generated, then no further step
