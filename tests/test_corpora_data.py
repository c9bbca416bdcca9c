"""The embedded corpora: content, size, frozen eval/train split, API errors."""

from __future__ import annotations

import re

import pytest

from ccq_eval.data import corpora
from ccq_eval.data.corpora import CorpusError, get_document, list_corpora, list_documents, load_corpus

DATA_DIR = corpora.DATA_DIR


@pytest.mark.parametrize("name", ["sotu", "kjv", "austen"])
def test_corpus_documents_are_unique_english_text(name):
    docs = load_corpus(name)
    ids = [doc.id for doc in docs]
    assert len(ids) == len(set(ids)), "document ids must be unique"
    for doc in docs:
        assert doc.text == doc.text.strip() and doc.text, doc.id
        assert not re.search(r"[\x00-\x09\x0b-\x1f]", doc.text), f"control characters in {doc.id}"
        # Natural English: mostly letters and spaces, and common function words occur.
        letters = sum(ch.isalpha() or ch == " " for ch in doc.text)
        assert letters / len(doc.text) > 0.85, doc.id
        words = doc.text.lower().split()
        assert sum(w in {"the", "and", "of", "to"} for w in words) / len(words) > 0.05, doc.id


def test_corpora_size_and_long_documents():
    total_chars = sum(len(doc.text) for name in list_corpora() for doc in load_corpus(name))
    assert total_chars > 2_000_000
    # Perplexity at 20K tokens needs held-out documents of 20K+ tokens; 20K words is a stricter
    # bar (English runs at more than one GPT-2 / SentencePiece token per word).
    long_eval = [
        (name, doc.id)
        for name in list_corpora()
        for doc in load_corpus(name, split="eval")
        if len(doc.text.split()) >= 20_000
    ]
    assert len(long_eval) >= 8, long_eval
    assert {name for name, _ in long_eval} == set(list_corpora())
    shipped = sum(p.stat().st_size for p in DATA_DIR.glob("*.jsonl.xz"))
    assert shipped < 8_000_000


@pytest.mark.parametrize("name", ["sotu", "kjv", "austen"])
def test_split_is_frozen_disjoint_and_follows_the_rule(name):
    docs = load_corpus(name)
    train, held_out = list_documents(name, "train"), list_documents(name, "eval")
    assert held_out and train
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(doc.id for doc in docs)
    # The rule written in build_corpora.py: sort by (characters, id), every 4th from the 2nd is eval.
    ordered = sorted(docs, key=lambda doc: (len(doc.text), doc.id))
    expected_eval = {doc.id for i, doc in enumerate(ordered) if i % 4 == 1}
    assert set(held_out) == expected_eval
    assert all(doc.split == "eval" for doc in load_corpus(name, split="eval"))


def test_natural_order_and_metadata():
    sotu = load_corpus("sotu")
    years = [doc.meta["year"] for doc in sotu]
    assert years == sorted(years) and years[0] == 1790 and years[-1] == 2021
    assert len(sotu) == 233
    kjv = load_corpus("kjv")
    assert len(kjv) == 66 and kjv[0].title.startswith("Genesis") and kjv[-1].title.startswith("Revelation")
    assert kjv[0].text.startswith("In the beginning God created the heaven and the earth.")
    pride = get_document("austen", "prideprejudice")
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune" in pride.text
    assert len(load_corpus("austen")) == 6


def test_bad_names_and_splits_are_rejected():
    with pytest.raises(CorpusError, match=r"unknown corpus 'wikitext'.*austen, kjv, sotu"):
        load_corpus("wikitext")
    with pytest.raises(CorpusError, match=r"unknown split 'test'.*all, train, eval"):
        load_corpus("sotu", split="test")
    with pytest.raises(CorpusError, match="no document 'nope'"):
        get_document("kjv", "nope")
