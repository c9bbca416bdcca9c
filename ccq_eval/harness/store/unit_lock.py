"""Per-unit locks: several processes (or machines sharing the folder) can run into one output folder;
whoever holds a unit's lock computes it, the others skip it or wait for it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class UnitFolder(Protocol):
    """What a lock needs of a unit (store.UnitDir): its folder."""

    path: Path


LOCK_FILE = ".lock"


class UnitLock:
    """An exclusive lock on one unit folder (filelock: flock, released when the process dies, so a
    killed worker never leaves a stale lock). On a filesystem without locks it warns once and lets
    the caller go on unlocked (a single process is then still safe)."""

    _warned = False

    def __init__(self, unit: UnitFolder):
        import filelock

        unit.path.mkdir(parents=True, exist_ok=True)
        self._timeout = filelock.Timeout
        self._lock = filelock.FileLock(str(unit.path / LOCK_FILE))
        self.held = False

    def acquire(self, blocking: bool) -> bool:
        """Take the lock; False when another process holds it and `blocking` is False."""
        try:
            self._lock.acquire(timeout=-1 if blocking else 0)
        except self._timeout:
            return False
        except (NotImplementedError, OSError) as exc:
            if not UnitLock._warned:
                logger.warning(
                    "cannot lock %s (%s): running without per-unit locks; do not run two "
                    "workers into this folder (use --shard K/N instead)",
                    self._lock.lock_file,
                    exc,
                )
                UnitLock._warned = True
            return True
        self.held = True
        return True

    def release(self) -> None:
        if self.held:
            self._lock.release()
            self.held = False
