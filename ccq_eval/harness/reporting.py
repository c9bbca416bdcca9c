"""Progress reporting of a run: silent, or rich progress bars on stderr."""

from __future__ import annotations

from typing import Any, Protocol

from ccq_eval.harness.plan import RunPlan, Unit


class Reporter(Protocol):
    def run_start(self, plan: RunPlan) -> None: ...
    def unit_start(self, unit: Unit, index: int, total: int) -> None: ...
    def requests(self, unit: Unit, done: int, total: int, cell: str) -> None: ...
    def unit_end(self, unit: Unit, status: str, detail: str = "") -> None: ...
    def run_end(self) -> None: ...


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


class RichReporter:
    """Two progress bars: units of the run, and requests of the current unit (with its cell)."""

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
        self.progress.advance(self._units_bar)
        message = f"{status}: {unit.model} / {unit.task}" + (f" ({detail})" if detail else "")
        self.progress.console.print(message, markup=False, highlight=False)

    def run_end(self) -> None:
        self.progress.stop()
