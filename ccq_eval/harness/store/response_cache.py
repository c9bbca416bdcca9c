"""The resume cache: a unit's model responses keyed by request, one SQLite row per response.

It exists while its unit runs (<unit>/responses.sqlite) and is deleted once the unit is stored: the
stored samples hold every answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

from ccq_eval.atomic_io import json_default
from ccq_eval.harness.store.files import RESPONSES_DB, ResultsError


class ResponseCache:
    """Model responses of one unit, committed as they arrive, so a killed run can resume.

    Values are JSON (never pickle). Keys hash the request type and arguments, computed
    before the model sees the request. `identity` (a digest of the unit's spec) is stored with the
    answers: a cache holding answers of another model or other settings is refused, never read.
    """

    def __init__(self, path: Path, identity: str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path))
        try:
            self._conn.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._conn.execute("CREATE TABLE IF NOT EXISTS identity (value TEXT NOT NULL)")
            self._conn.commit()
            if identity is not None:
                self._claim(identity)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise ResultsError(cache_error_message(self.path, exc)) from None
        except ResultsError:
            self._conn.close()
            raise

    def _claim(self, identity: str) -> None:
        row = self._conn.execute("SELECT value FROM identity").fetchone()
        if row is not None and row[0] != identity and len(self):
            raise ResultsError(
                f"{self.path} holds answers of another model or other settings; delete it to recompute "
                "this unit (other units are unaffected)")
        with self._conn:
            self._conn.execute("DELETE FROM identity")
            self._conn.execute("INSERT INTO identity (value) VALUES (?)", (identity,))

    @staticmethod
    def key(request_type: str, args: tuple[Any, ...]) -> str:
        payload = json.dumps([request_type, list(args)], sort_keys=True, default=json_default)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get_many(self, keys: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), 500):
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self._conn.execute(f"SELECT key, value FROM responses WHERE key IN ({marks})", chunk)
            for key, value in rows:
                found[key] = json.loads(value)
        return found

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        try:
            with self._conn:  # one transaction: all of a batch or none of it
                self._conn.executemany(
                    "INSERT OR REPLACE INTO responses (key, value) VALUES (?, ?)",
                    [(key, json.dumps(value, default=json_default)) for key, value in items],
                )
        except sqlite3.OperationalError as exc:
            raise ResultsError(cache_error_message(self.path, exc)) from None

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._conn.close()


def spec_identity(spec: dict[str, Any]) -> str:
    """A digest of what a unit computes (its unit.json), stored with its resume cache."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=json_default).encode("utf-8")).hexdigest()


def remove_resume_cache(responses_db: Path) -> None:
    """Delete a stored unit's resume cache (and sqlite's journal beside it): a finished unit is never
    resumed, and the cache of a perplexity unit holds every token's log-likelihood."""
    for path in (responses_db, responses_db.with_name(RESPONSES_DB + "-journal")):
        path.unlink(missing_ok=True)


def unreadable_cache_message(path: Path, exc: Exception) -> str:
    return (f"{path} is not a readable SQLite database ({exc}: truncated or corrupt); delete it to "
            "recompute this unit's answers (finished units are unaffected)")


# sqlite's result codes (extended codes start with these) for a cache it could not write, as opposed to one
# it cannot read; and its messages for them, for an error that carries no code
_UNWRITABLE_CODES = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_READONLY", "SQLITE_CANTOPEN")
_UNWRITABLE = ("disk is full", "disk i/o error", "readonly database", "unable to open")


def _unwritable(exc: Exception) -> bool:
    """Whether sqlite refused to write (full disk, I/O error, read-only or unopenable file): by its result
    code where the error carries one (Python 3.11+), else by its message."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorname", None)
    if code is not None:
        return code.startswith(_UNWRITABLE_CODES)
    return any(text in str(exc).lower() for text in _UNWRITABLE)


def cache_error_message(path: Path, exc: Exception) -> str:
    """The one line for a resume cache sqlite refused: a full disk or a folder that cannot be written
    keeps the answers stored so far (the cache is valid; deleting it would lose them), anything else
    is a damaged file."""
    if _unwritable(exc):
        return (f"cannot write the resume cache {path} ({exc}); the answers it holds are kept: free disk "
                "space (or make the folder writable) and rerun the same command to resume")
    return unreadable_cache_message(path, exc)


def answered_count(path: Path) -> int:
    """How many answers a unit's resume cache holds (0 when there is none); ResultsError when it is
    corrupt. Checks the whole file (sqlite's quick_check), so a truncated cache is found before a run."""
    path = Path(path)
    if not path.is_file():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(str(path))) as conn:
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "responses" not in tables:
                return 0
            return int(conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise ResultsError(cache_error_message(path, exc)) from None
