"""A user's own corpus files: .txt, .jsonl, folders, and the errors for bad files."""

from __future__ import annotations

import json
import re

import pytest

from ccq_eval.data.corpora import CorpusError, read_user_corpus, resolve_corpus


def test_txt_file_is_one_document(tmp_path):
    path = tmp_path / "story.txt"
    path.write_text("\ufeffOnce upon a time.\nThe end.\n", encoding="utf-8")
    (doc,) = read_user_corpus(path)
    assert doc.id == "story" and doc.text == "Once upon a time.\nThe end.\n"  # BOM dropped, text kept


def test_folder_of_txt_files_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    docs = read_user_corpus(tmp_path)
    assert [(d.id, d.text) for d in docs] == [("a", "first"), ("b", "second")]


def test_jsonl_documents_with_ids_titles_and_extra_fields(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"id": "x1", "title": "One", "text": "alpha beta", "source": "s"}, {"text": "gamma"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    docs = read_user_corpus(path)
    assert [(d.id, d.title, d.text) for d in docs] == [("x1", "One", "alpha beta"), ("docs:2", "docs:2", "gamma")]
    assert docs[0].meta == {"source": "s"}


@pytest.mark.parametrize("content", [b"", b"  \n\t\n"])
def test_empty_txt_is_rejected_with_its_path(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    with pytest.raises(CorpusError, match=re.escape(str(path)) + " is empty"):
        read_user_corpus(path)


def test_empty_jsonl_is_rejected_with_its_path(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(str(path)) + " is empty"):
        read_user_corpus(path)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_non_utf8_is_rejected_with_its_path(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes('{"text": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(CorpusError, match=re.escape(str(path)) + " is not UTF-8 text .*offset 13"):
        read_user_corpus(path)


def test_bad_jsonl_lines_name_path_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(f"{path}:2: ") + '.*string field "text"'):
        read_user_corpus(path)
    path.write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(f"{path}:2: not a JSON object")):
        read_user_corpus(path)
    path.write_text('{"text": "  "}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=re.escape(f'{path}:1: field "text" is empty')):
        read_user_corpus(path)


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(CorpusError, match=re.escape(f"corpus file {tmp_path / 'nope.txt'} does not exist")):
        read_user_corpus(tmp_path / "nope.txt")
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"unsupported corpus file type '\.csv'"):
        read_user_corpus(tmp_path / "data.csv")
    empty_dir = tmp_path / "empty_dir"
    empty_dir.mkdir()
    with pytest.raises(CorpusError, match=re.escape(f"{empty_dir} is a folder without .txt files")):
        read_user_corpus(empty_dir)


def test_resolve_corpus_takes_names_or_paths(tmp_path):
    assert resolve_corpus("kjv", split="eval") and all(d.split == "eval" for d in resolve_corpus("kjv", "eval"))
    path = tmp_path / "mine.txt"
    path.write_text("Some text.", encoding="utf-8")
    assert [d.text for d in resolve_corpus(str(path))] == ["Some text."]
    with pytest.raises(CorpusError, match="neither an embedded corpus"):
        resolve_corpus(str(tmp_path / "missing.txt"))
