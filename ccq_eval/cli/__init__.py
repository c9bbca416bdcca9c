"""ccq-eval: evaluate linear-attention LMs with and without CCQ on long-context tasks.

Thin typer front end (`ccq-eval`, `python -m ccq_eval`); the work happens in ccq_eval.harness (plan,
runner, results) and ccq_eval.analysis (tables, stats, figures). One module per command group: run.py,
analysis.py (table, compare, figures, report, archive), inspect.py, listing.py (tasks, models),
lm_eval.py (lm-eval's own CLI); errors.py turns exceptions into one line, common.py holds what several
share. Imports are lazy: `tasks`, `models`, `table`, `compare`, `figures` and `report` read files and never
load torch, fla or a model, and argument errors appear at once.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ccq_eval import logs
from ccq_eval.cli import analysis, inspect, listing, lm_eval, run
from ccq_eval.cli.common import Verbosity
from ccq_eval.cli.errors import one_line_errors


class _App(typer.Typer):
    """typer.Typer whose commands report unexpected errors in one line (errors.one_line_errors)."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda function: register(one_line_errors(function))


app = _App(
    name="ccq-eval",
    help="Long-context evaluation of linear-attention LMs (GLA, Gated DeltaNet) with and without CCQ.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names instead of cutting them off
)


def _version(show: bool) -> None:
    if show:
        from ccq_eval import __version__

        typer.echo(f"ccq-eval {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbosity: Annotated[Verbosity, typer.Option(
        "--verbosity", case_sensitive=False, help="Log level of ccq-eval and lm-eval messages (DEBUG also "
        "shows tracebacks).")] = Verbosity.WARNING,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """Long-context evaluation of linear-attention LMs (GLA, Gated DeltaNet) with and without CCQ."""
    logs.configure(verbosity.value)


# The commands, in the order --help lists them.
app.command("run")(run.run)
app.command("table")(analysis.table)
app.command("compare")(analysis.compare)
app.command("figures")(analysis.figures)
app.command("report")(analysis.report)
app.command("archive")(analysis.archive)
app.command("inspect")(inspect.inspect)
app.command("tasks")(listing.tasks)
app.command("models")(listing.models)
app.command("lm-eval", context_settings=lm_eval.CONTEXT_SETTINGS)(lm_eval.lm_eval_cli)

__all__ = ["app"]
