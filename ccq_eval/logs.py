"""Logging for the command line: one verbosity for ccq-eval and lm-eval, each warning shown once.

lm-eval repeats some warnings for every task of every unit (the `--metadata` hint of tasks that
build their own data, "Metrics were not scored on the same number of documents"); a run shows
each of them once. Imports only the standard library.
"""

from __future__ import annotations

import logging
import re
import sys

VERBOSITY_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# lm-eval's advice to pass kwargs through --metadata: noise when the metadata was given.
METADATA_HINT = "Custom kwargs can be passed to `--metadata`"
_TASK_PREFIX = re.compile(r"^\[[^\]]+\]\s*|^[\w.\-]+:\s")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def message_shape(message: str) -> str:
    """A warning with its task name and numbers taken out: repeats of one warning share it."""
    return _NUMBER.sub("#", _TASK_PREFIX.sub("", message))


class OncePerRun(logging.Filter):
    """Passes each warning (or error) shape once; with `drop_metadata_hint`, lm-eval's --metadata hint
    never. Records below WARNING pass unchanged."""

    def __init__(self, drop_metadata_hint: bool = False) -> None:
        super().__init__()
        self.drop_metadata_hint = drop_metadata_hint
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if self.drop_metadata_hint and METADATA_HINT in message:
            return False
        key = (record.name, message_shape(message))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(verbosity: str = "WARNING") -> OncePerRun:
    """Log ccq-eval's and lm-eval's records at `verbosity` or above to stderr, each warning once.

    Returns the filter, so that a command can switch on dropping lm-eval's --metadata hint.
    """
    level = logging.getLevelName(verbosity.upper())
    if not isinstance(level, int):
        raise ValueError(f"verbosity {verbosity!r}: valid choices are {', '.join(VERBOSITY_LEVELS)}")
    once = OncePerRun()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))
    handler.addFilter(once)
    for name in ("ccq_eval", "lm_eval"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers = [handler]
        logger.propagate = False
    return once


def silence_progress_bars() -> None:
    """`run --quiet`: no progress bars from lm-eval, transformers or datasets. tqdm (>= 4.66) takes
    TQDM_DISABLE as its default when it is imported, and huggingface_hub / transformers read
    HF_HUB_DISABLE_PROGRESS_BARS then, so this runs before the command imports any of them; a tqdm
    imported earlier gets the same default (disable=True, which a caller can still override)."""
    import functools
    import os

    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    std = sys.modules.get("tqdm.std")
    init = std.tqdm.__dict__.get("__init__") if std is not None else None
    if isinstance(init, functools.partialmethod):  # the defaults tqdm read from the environment at import
        defaults = {**init.keywords, "disable": True}
        std.tqdm.__init__ = functools.partialmethod(init.func, *init.args, **defaults)
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def hand_over_to_lm_eval(once: OncePerRun) -> None:
    """Before lm-eval's own CLI runs: let it set up its log handler (it would add a second one), with
    `once` on it; ccq-eval's handler stays on ccq_eval's records."""
    from lm_eval.utils import setup_logging

    lm_eval_logger = logging.getLogger("lm_eval")
    ours = list(lm_eval_logger.handlers)
    lm_eval_logger.handlers = []
    setup_logging(lm_eval_logger.level)
    if not lm_eval_logger.handlers:  # lm-eval set up its logging earlier in this process: keep ours
        lm_eval_logger.handlers = ours
    for handler in lm_eval_logger.handlers:
        handler.addFilter(once)
