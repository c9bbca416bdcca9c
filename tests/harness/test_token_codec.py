"""ccq_eval.harness.tokens.TokenCodec.encode_all: the ids encode() gives, in request order, on threads."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ccq_eval.harness import tokens
from ccq_eval.harness.tokens import TokenCodec

MISTRAL_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers" / "mistral_v1"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MISTRAL_DIR))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_encode_all_equals_encode_in_order(tokenizer, monkeypatch, threads):
    """Texts of very different lengths (so threads finish out of order), English, Chinese and code,
    each equal to encode()'s ids at its own position; a tokenizer left with truncation on by an earlier
    caller still encodes whole texts."""
    monkeypatch.setattr(tokens, "MAX_ENCODE_THREADS", threads)
    monkeypatch.setattr(tokens.os, "cpu_count", lambda: 8)
    words = "the recurrent state keeps a fixed size while the key covariance grows".split()
    texts = [" ".join(words[: 1 + i % len(words)]) * (1 + (i * 37) % 200) for i in range(24)]
    texts += ["北京是中国的首都。" * 50, "def f(x):\n    return x + 1\n" * 30, ""]
    tokenizer.backend_tokenizer.enable_truncation(max_length=8)  # what another caller may leave behind
    tokenizer(texts[0], truncation=True, max_length=8)
    codec = TokenCodec(tokenizer)
    expected = [codec.encode(text) for text in texts]
    assert max(map(len, expected)) > 2000 and expected[-1] == []
    assert codec.encode_all(iter(texts)) == expected
    assert codec.encode_all([]) == []
