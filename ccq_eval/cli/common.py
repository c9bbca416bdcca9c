"""What several commands share: choice enums (listed here, so that --help needs no import of the
harness), path options, and writing a command's text to stdout or a file."""

from __future__ import annotations

from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ccq_eval import logs
from ccq_eval.cli.errors import fail


class TableFormat(StrEnum):
    markdown = "markdown"
    csv = "csv"
    latex = "latex"


class TableView(StrEnum):
    paper = "paper"
    tidy = "tidy"
    ruler = "ruler"


class PAdjust(StrEnum):
    holm = "holm"
    bonferroni = "bonferroni"
    none = "none"


# RULER's effective-length threshold: the score of Llama-2-7B at 4K (NVIDIA/RULER README).
DEFAULT_RULER_THRESHOLD = 85.6
ThresholdOpt = Annotated[float, typer.Option(
    help="RULER view: the effective length is the longest length up to which the average over the RULER "
    "tasks stays at or above this accuracy (%); RULER's is 85.6.")]
PAdjustOpt = Annotated[PAdjust, typer.Option(
    "--p-adjust", help="Adjust the p-values for the number of comparisons printed: holm (default), "
    "bonferroni, or none (raw p-values are shown beside the adjusted ones).")]


# Values of --dtype (ccq_eval.harness.options.DTYPE_CHOICES, listed here so that --help needs no import).
Dtype = Enum("Dtype", {name: name for name in (
    "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")}, type=str)
Verbosity = Enum("Verbosity", {name: name for name in logs.VERBOSITY_LEVELS}, type=str)
# Values of --suite (ccq_eval.harness.suites.SUITES, listed here so that --help needs no import).
SuiteName = Enum("SuiteName", {name: name for name in ("paper", "ruler", "zeroshot")}, type=str)
# Values of --rolling-windows (ccq_eval.harness.zeroshot.ROLLING_PROTOCOLS).
RollingWindows = Enum("RollingWindows", {name: name for name in ("hflm", "carry")}, type=str)


def path_option(text: str | Path) -> Path | str:
    """The value of a path option (typer passes the default as it is); an empty one stays "" (Path("")
    would be the current folder), which given_path refuses."""
    return Path(text) if isinstance(text, Path) or text.strip() else ""


def given_path(value: Path | str | None) -> Path | None:
    """A path option's value; an empty one (see path_option) is a usage error."""
    if isinstance(value, str):
        fail("--output is empty; give a path, or leave the option out for its default")
    return value


ResultsArg = Annotated[Path, typer.Argument(help="Results folder written by `ccq-eval run` (or lm-eval).")]
FormatOpt = Annotated[TableFormat, typer.Option("--format", "-f", help="Output format.")]
OutputFileOpt = Annotated[Path | None, typer.Option(
    "--output", "-o", parser=path_option, metavar="PATH", help="Write to this file (default: stdout).")]


def emit(text: str, output: Path | None) -> None:
    """`text` on stdout, or written to the file `output` (atomically) with a note on stderr."""
    if output is None:
        typer.echo(text, nl=False)
        return
    from ccq_eval.atomic_io import atomic_write_text

    if output.is_dir():
        fail(f"--output {output} is a folder; give the path of a file to write")
    atomic_write_text(output, text)
    typer.echo(f"wrote {output}", err=True)
