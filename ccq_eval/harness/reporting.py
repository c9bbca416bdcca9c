"""Progress reporting of a run on stderr: one line per unit (the default), nothing, or rich progress bars.

A unit that another worker finished is counted in the run's summary and has no line of its own: the
helper processes of the same command report their units through the command's reporter (workers.py),
and another command's units are that command's to report.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Protocol

from ccq_eval.harness.plan import RunPlan, Unit

logger = logging.getLogger(__name__)
# The status of a unit found finished by another worker when this process came to it.
DONE_ELSEWHERE = "done by another worker"


class Reporter(Protocol):
    def run_start(self, plan: RunPlan) -> None: ...
    def unit_start(self, unit: Unit, index: int, total: int) -> None: ...
    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None: ...
    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None: ...
    def run_end(self) -> None: ...


def unit_line(unit: Unit, status: str, detail: str = "") -> str:
    """`done: tiny-gla / ccq_s_niah_1 (10.4 s)`: a unit's status, with its detail when there is one."""
    return f"{status}: {unit.model} / {unit.task}" + (f" ({detail})" if detail else "")


class SilentReporter:
    def run_start(self, plan: RunPlan) -> None:
        pass

    def unit_start(self, unit: Unit, index: int, total: int) -> None:
        pass

    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None:
        pass

    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None:
        pass

    def run_end(self) -> None:
        pass


class LineReporter(SilentReporter):
    """One line on stderr as each unit ends (`done: MODEL / TASK (12.3 s)`, `failed: ...`); a unit another
    worker finished is logged at INFO only. Safe to call from the thread that relays helper processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None:
        if status == DONE_ELSEWHERE:
            logger.info("%s", unit_line(unit, status, detail))
            return
        with self._lock:
            print(unit_line(unit, status, detail), file=sys.stderr, flush=True)


class RichReporter:
    """Two progress bars: units of the run, and requests of the current unit (with its cell); a line per
    unit as it ends, but none for a unit another worker finished (the units bar counts it once)."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}", markup=False),  # names and cells may hold [ ]
            TextColumn("{task.fields[cell]}", style="cyan", markup=False),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._units_bar: Any = None
        self._requests_bar: Any = None
        self._ended: set[tuple[str, str]] = set()

    def run_start(self, plan: RunPlan) -> None:
        self.progress.start()
        skipped = len(plan.units) - len(plan.pending)
        self._units_bar = self.progress.add_task(
            "units", total=len(plan.units), completed=skipped, cell=f"({skipped} already done)"
        )

    def unit_start(self, unit: Unit, index: int, total: int) -> None:
        if self._requests_bar is not None:
            self.progress.remove_task(self._requests_bar)
        self._requests_bar = self.progress.add_task(f"{unit.model} / {unit.task}", total=None, cell="")

    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None:
        self.progress.update(self._requests_bar, completed=done, total=total, cell=f"[{cell}]" if cell else "")

    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None:
        key = (unit.model, unit.task)
        if key not in self._ended:  # a helper's unit ends twice: in the helper, then found done here
            self._ended.add(key)
            self.progress.advance(self._units_bar)
        if status == DONE_ELSEWHERE:
            logger.info("%s", unit_line(unit, status, detail))
            return
        self.progress.console.print(unit_line(unit, status, detail), markup=False, highlight=False)

    def run_end(self) -> None:
        self.progress.stop()
