"""Console output of the command line: one verbosity for ccq-eval and lm-eval, each warning shown once,
and no progress bars or library messages that a user of ccq-eval cannot act on.

lm-eval repeats some warnings for every task of every unit (the `--metadata` hint of tasks that build
their own data, "Metrics were not scored on the same number of documents"); a run shows each of them
once. Everything here goes through public switches: handlers and filters of the logging module (the
handler is this module's own; filters sit on named loggers), the `warnings` filters, and the environment
variables that tqdm, huggingface_hub and datasets read when they are imported. Imports only the
standard library.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

VERBOSITY_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# lm-eval's advice to pass kwargs through --metadata: noise when the metadata was given.
METADATA_HINT = "Custom kwargs can be passed to `--metadata`"
# Loggers of ccq-eval and lm-eval: --verbosity sets their level, and this module's handler prints them.
OUR_LOGGERS = ("ccq_eval", "lm_eval")
# lm-eval loggers whose warnings repeat for every task; under lm-eval's own CLI (which prints lm_eval's
# records through its own handler) the once-per-run filter sits on these loggers.
LM_EVAL_REPEATING_LOGGERS = ("lm_eval.api.task", "lm_eval.evaluator_utils")
# Library warnings (warnings.warn) that say nothing a ccq-eval user can act on: (message start, category).
UNACTIONABLE_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    # fla on a machine without a GPU (fla/utils/hardware.py): its CPU fallback is what ccq-eval runs there.
    ("Triton is not supported on current platform", UserWarning),
    # transformers 5's generate() about fla 0.6.0's prepare_inputs_for_generation, which still passes the
    # cache as `past_key_values` (fla/models/generation_utils.py); the cache is used either way.
    ("`past_key_values` is deprecated and will be removed", FutureWarning),
    ("Both `past_key_values` and `cache` are set", FutureWarning),
)
# Library log records that say nothing a ccq-eval user can act on: logger name -> patterns of messages.
UNACTIONABLE_RECORDS: dict[str, tuple[re.Pattern[str], ...]] = {
    # transformers 5 about the output fields of fla 0.6.0's models, which still name the cache
    # `past_key_values` (transformers/utils/generic.py).
    "transformers.utils.generic": (re.compile(re.escape("`past_key_values`/`cache_params` are deprecated")),),
    # Our tasks declare a metric per length (acc_1024, ...), each over the documents of its length only.
    "lm_eval.evaluator_utils": (re.compile(r"^\[ccq_[\w.\-]+\] Metrics were not scored on the same number"),),
    # lm-eval's own configs of the zero-shot suite (wikitext, boolq) leave a metric's aggregation or direction
    # to lm-eval's defaults, which is what the papers' numbers use.
    "lm_eval.api.task": (re.compile(r"metric \w+ is defined, but (aggregation|higher_is_better) is not\. "
                                    r"using default"),),
    # lm-eval's own super_glue/boolq and super_glue/copa folders (the zero-shot suite's) both name a T5-prompt
    # task super-glue-t5-prompt: its index says so on every zero-shot run; neither task runs here.
    "lm_eval.tasks._index": (re.compile(r"^Task 'super-glue-[\w\-]+' from .* overrides existing task"),),
}
# Environment variables read at import: tqdm (>= 4.66) takes TQDM_DISABLE as its default for `disable`;
# huggingface_hub (and transformers' own bars, through it) and datasets turn their progress bars off.
PROGRESS_BAR_SWITCHES = {
    "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
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


class Unactionable(logging.Filter):
    """Drops the records of one logger whose message matches one of `patterns`."""

    def __init__(self, patterns: tuple[re.Pattern[str], ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(pattern.search(message) for pattern in self.patterns)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (test runners swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@dataclass
class _Setup:
    """What configure installed, so that the next configure (a second command in one process) removes it."""

    handler: _StderrHandler
    once: OncePerRun
    logger_filters: list[tuple[str, logging.Filter]] = field(default_factory=list)

    def add_filter(self, logger_name: str, log_filter: logging.Filter) -> None:
        logging.getLogger(logger_name).addFilter(log_filter)
        self.logger_filters.append((logger_name, log_filter))

    def remove(self) -> None:
        for name in OUR_LOGGERS:
            logging.getLogger(name).removeHandler(self.handler)
        for name, log_filter in self.logger_filters:
            logging.getLogger(name).removeFilter(log_filter)


_current: _Setup | None = None


def configure(verbosity: str = "WARNING") -> OncePerRun:
    """Log ccq-eval's and lm-eval's records at `verbosity` or above to stderr, each warning once, and drop
    the library warnings and records a user cannot act on (UNACTIONABLE_WARNINGS / _RECORDS).

    Returns the once-per-run filter (drop_metadata_hint switches off lm-eval's --metadata hint).
    """
    global _current
    if verbosity.upper() not in VERBOSITY_LEVELS:
        raise ValueError(f"verbosity {verbosity!r}: valid choices are {', '.join(VERBOSITY_LEVELS)}")
    level = logging.getLevelName(verbosity.upper())
    if _current is not None:
        _current.remove()
    once = OncePerRun()
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s [%(name)s] %(message)s"))
    handler.addFilter(once)
    _current = _Setup(handler, once)
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.addHandler(handler)
    for name, patterns in UNACTIONABLE_RECORDS.items():
        _current.add_filter(name, Unactionable(patterns))
    ignore_unactionable_warnings()
    return once


def drop_metadata_hint(drop: bool = True) -> None:
    """Leave out lm-eval's advice to pass --metadata (the command passes every task its metadata)."""
    if _current is not None:
        _current.once.drop_metadata_hint = drop


def ignore_unactionable_warnings() -> None:
    """warnings filters for UNACTIONABLE_WARNINGS (a process's own: spawned helpers call this too)."""
    for message, category in UNACTIONABLE_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


def hide_progress_bars() -> None:
    """No progress bars from tqdm, huggingface_hub, transformers or datasets in this process and the ones
    it starts: the switches they read when imported, so this runs before the command imports any of them
    (the libraries already imported get their own public switch where they have one)."""
    os.environ.update(PROGRESS_BAR_SWITCHES)
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def hand_over_to_lm_eval() -> None:
    """Before lm-eval's own CLI runs in this process: it prints lm_eval's records through the handler it
    sets up, so this module's handler leaves the lm_eval logger (no line twice), and the once-per-run
    filter moves onto the lm-eval loggers whose warnings repeat per task."""
    if _current is None:
        return
    logging.getLogger("lm_eval").removeHandler(_current.handler)
    for name in LM_EVAL_REPEATING_LOGGERS:
        _current.add_filter(name, _current.once)


@contextlib.contextmanager
def transformers_errors_only():
    """transformers' own log shows errors only inside the block (its previous level after it)."""
    from transformers.utils import logging as transformers_logging

    before = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(before)
