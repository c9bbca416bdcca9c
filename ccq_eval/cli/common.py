"""What several command groups share: the choices of --dtype and --verbosity (listed here, so that --help
needs no import of the harness) and path options."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from ccq_eval import logs
from ccq_eval.cli.errors import fail

# Values of --dtype (ccq_eval.harness.options.DTYPE_CHOICES, listed here so that --help needs no import).
Dtype = Enum("Dtype", {name: name for name in (
    "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")}, type=str)
Verbosity = Enum("Verbosity", {name: name for name in logs.VERBOSITY_LEVELS}, type=str)


def path_option(text: str | Path) -> Path | str:
    """The value of a path option (typer passes the default as it is); an empty one stays "" (Path("")
    would be the current folder), which given_path refuses."""
    return Path(text) if isinstance(text, Path) or text.strip() else ""


def given_path(value: Path | str | None) -> Path | None:
    """A path option's value; an empty one (see path_option) is a usage error."""
    if isinstance(value, str):
        fail("--output is empty; give a path, or leave the option out for its default")
    return value
