"""ccq_eval.harness.tokens.on_threads and ahead_on_threads with TokenCodec.encode: the ids encode() gives,
in order."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ccq_eval.harness import tokens
from ccq_eval.harness.tokens import TokenCodec, ahead_on_threads, on_threads

MISTRAL_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers" / "mistral_v1"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MISTRAL_DIR))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_encoding_on_threads_equals_encode_in_order(tokenizer, monkeypatch, threads):
    """Texts of very different lengths (so threads finish out of order), English, Chinese and code,
    each equal to encode()'s ids at its own position; a tokenizer left with truncation on by an earlier
    caller still encodes whole texts (TokenCodec.settle resets it on one thread first)."""
    monkeypatch.setattr(tokens, "MAX_ENCODE_THREADS", threads)
    monkeypatch.setattr(tokens.os, "cpu_count", lambda: 8)
    words = ["the", "recurrent", "state", "keeps", "a", "fixed", "size", "while", "the", "key", "grows"]
    texts = [" ".join(words[: 1 + i % len(words)]) * (1 + (i * 37) % 200) for i in range(24)]
    texts += ["北京是中国的首都。" * 50, "def f(x):\n    return x + 1\n" * 30, ""]
    codec = TokenCodec(tokenizer)
    expected = [codec.encode(text) for text in texts]
    assert max(map(len, expected)) > 2000 and expected[-1] == []

    def leave_truncation_on():  # what another caller may leave behind
        tokenizer(texts[0], truncation=True, max_length=8)
        assert tokenizer.backend_tokenizer.truncation is not None

    leave_truncation_on()
    assert on_threads(codec.encode, iter(texts), codec.settle) == expected
    leave_truncation_on()
    ahead = ahead_on_threads(codec.encode, texts, codec.settle)
    assert next(ahead) == expected[0]  # lazily: the first text before the iterator is used up
    assert [expected[0], *ahead] == expected
    assert on_threads(codec.encode, [], codec.settle) == []
    assert list(ahead_on_threads(codec.encode, [], codec.settle)) == []


def test_prompts_cut_on_threads_equal_one_at_a_time(monkeypatch):
    """Generator._prepare tokenises and cuts prompts on threads: the same ids as encode() then fit() one
    after another, in request order, and the same truncation counts (a repeated Instance counted once);
    multi-byte characters at the cut points exercise the middle policy's character boundaries."""
    from adapter_support import byte_tokenizer, tiny_model
    from lm_eval.api.instance import Instance

    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.harness.truncation import Truncator

    monkeypatch.setattr(tokens, "MAX_ENCODE_THREADS", 4)
    monkeypatch.setattr(tokens.os, "cpu_count", lambda: 8)
    tokenizer = byte_tokenizer()
    lm = CCQEvalLM(model=tiny_model(tokenizer), tokenizer=tokenizer, max_length=120)
    contexts = [("ab" * n + "北京" * n + "cd" * n) for n in (3, 20, 41, 7, 60, 33)]
    requests = [
        Instance(
            "generate_until", {}, (text, {"until": ["\n"], "max_gen_toks": 8, "ccq_truncation": "middle"}), i
        )
        for i, text in enumerate(contexts)
    ]
    requests.append(requests[2])  # lm-eval's padding reuses an Instance
    prepared = lm.generator._prepare(requests)

    serial = Truncator(lm.codec, 120, "error")
    expected = [
        lm.codec.prefix
        + serial.fit(
            lm.codec.encode(request.args[0]),
            120 - 8 - len(lm.codec.prefix),
            "middle",
            None,
            "x",
            count=index < len(contexts),
        )
        for index, request in enumerate(requests)
    ]
    assert [ids for ids, _ in prepared] == expected
    assert lm.truncator.n_truncated == serial.n_truncated == 4
    assert lm.truncator.policy_counts == serial.policy_counts == {"middle": len(contexts)}
