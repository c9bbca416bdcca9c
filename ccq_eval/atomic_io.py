"""Atomic file writes and the JSON form results are stored in, below both model/ and harness/.

A file is written to a temporary file in its folder, flushed to disk and moved over the old one
(os.replace), so a process killed at any moment leaves either the old file or the new one, never half
of one; the new file gets the mode open() would give it.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError


def json_default(obj: Any) -> Any:
    """A JSON-able stand-in for a value json cannot write."""
    # Same conversions as lm-eval's handle_non_serializable, without importing lm-eval here.
    try:
        import numpy as np

        if isinstance(obj, np.bool_):
            return bool(obj)
        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return float(obj)
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """JSON text of `obj` as results files hold it (numpy values, sets and paths converted)."""
    return json.dumps(obj, indent=indent, default=json_default, ensure_ascii=False)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one."""
    atomic_write_bytes(path, text.encode("utf-8"))


_UMASK: int | None = None


def _file_mode() -> int:
    """0666 less the process umask: the mode open() would give a new file (mkstemp gives 0600, which
    would make a shared results folder unreadable to colleagues)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return 0o666 & ~_UMASK


class WriteError(UserError, OSError):
    """A file that could not be written (a full disk, a quota, a read-only folder); an OSError whose message
    names the file and the fix, where the operating system's names neither."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message alone, without OSError's "[Errno N]"


# Where the disk, not the file, is the cause: the fix is space, not a path.
_NO_SPACE = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def write_error(path: Path, exc: OSError) -> OSError:
    """`exc` (raised while writing `path`) as one line naming `path` and the fix; an error that names its
    file already, or is a WriteError, as it is."""
    if isinstance(exc, WriteError) or (exc.filename is not None and exc.errno not in _NO_SPACE):
        return exc
    fix = ("free space on that disk (or write to another one)" if exc.errno in _NO_SPACE
           else "make the folder writable (or write elsewhere)")
    return WriteError(exc.errno, f"cannot write {path}: {exc.strerror or exc}; {fix}, then rerun the same "
                                 "command (what was stored before is kept)")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and os.replace, so readers see
    the old file or the whole new one; the temporary file is removed when the write fails, and an OSError
    becomes one naming `path` (write_error)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON (dumps) with a final newline, written atomically."""
    atomic_write_text(path, dumps(obj) + "\n")
