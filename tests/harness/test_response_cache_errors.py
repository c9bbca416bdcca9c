"""How a resume cache's sqlite errors read: one sqlite could not write keeps the cache (its answers are
valid), one it could not read is a damaged file. Real sqlite errors, classified by their result code."""

from __future__ import annotations

import sqlite3

import pytest

from ccq_eval.harness.store.response_cache import cache_error_message


def _error(action) -> sqlite3.Error:
    with pytest.raises(sqlite3.Error) as raised:
        action()
    return raised.value


def test_a_read_only_cache_keeps_its_answers_and_a_damaged_one_is_named(tmp_path):
    db = tmp_path / "responses.sqlite"
    with sqlite3.connect(db) as connection:
        connection.execute("create table answers (value)")
    read_only = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    refused = _error(lambda: read_only.execute("insert into answers values (1)"))
    read_only.close()
    assert refused.sqlite_errorname.startswith("SQLITE_READONLY")
    assert cache_error_message(db, refused).startswith(f"cannot write the resume cache {db}")

    db.write_bytes(b"not a database " * 100)
    damaged = _error(lambda: sqlite3.connect(db).execute("select * from answers"))
    assert cache_error_message(db, damaged).startswith(f"{db} is not a readable SQLite database")
